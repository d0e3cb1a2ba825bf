"""Image-caption sources for data_prep. One file per source; each defines `SOURCE = <class>`."""
from data_prep.sources.base import ImageCaptionSource, Record, get_source

__all__ = ["ImageCaptionSource", "Record", "get_source"]
