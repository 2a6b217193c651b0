"""One module per group of endpoints; each builds an APIRouter over the shared `Serving`."""
