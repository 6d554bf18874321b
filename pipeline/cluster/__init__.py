"""The Dask cluster a run uses: connecting to one, starting the embedded one (fork server, start-up), hosts behind shaped links, TLS, the object store."""
