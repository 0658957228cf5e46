"""The HTTP layer of api: the ASGI app, its routes and pages, rendering."""
