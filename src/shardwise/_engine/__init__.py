"""The one engine behind both public APIs. No public names live here."""
