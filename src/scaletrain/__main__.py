from scaletrain.cli.main import entrypoint

entrypoint()
