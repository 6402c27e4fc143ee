"""The export cache: `vllm serve MODEL` and `from_pretrained(MODEL, export=True)` on a plain
checkpoint export it once into a folder found again by key (store.py, source.py);
`python -m optimum_neuron_chunked.export_cache list|rm` lists and removes entries."""

from .build import cached_export
from .store import ENV, ExportCacheError, cache_root, entries, remove

__all__ = ["ENV", "ExportCacheError", "cache_root", "cached_export", "entries", "remove"]
