"""The application services of api, below the HTTP layer: no route, no template."""
