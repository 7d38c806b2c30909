"""Great Expectations' Data Docs page views with their Jinja templates compiled once per process.

GE builds a new Jinja environment for every view it makes, so each `build_data_docs` compiled its ~50
page templates again: about 0.25 s of the dataset validation's fixed cost. These views are GE's own,
given (through the site configuration's `view` entries, GE's documented extension point) a bytecode
cache kept in this process's memory: templates are still read from GE's package and checked against
their source, only the compilation is reused. Nothing is written to disk.
"""

from __future__ import annotations

import threading
from typing import Any

from great_expectations.render.view import DefaultJinjaIndexPageView, DefaultJinjaPageView
from jinja2 import BytecodeCache
from jinja2.bccache import Bucket


class _ProcessBytecodeCache(BytecodeCache):
    """Compiled templates by Jinja's bucket key (template name and source checksum), for this process."""

    def __init__(self) -> None:
        self._code: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def load_bytecode(self, bucket: Bucket) -> None:
        with self._lock:
            code = self._code.get(bucket.key)
        if code is not None:
            bucket.bytecode_from_string(code)

    def dump_bytecode(self, bucket: Bucket) -> None:
        code = bucket.bytecode_to_string()
        with self._lock:
            self._code[bucket.key] = code

    def clear(self) -> None:
        with self._lock:
            self._code.clear()


TEMPLATE_CACHE = _ProcessBytecodeCache()


class _CachedTemplates:
    """Gives a GE Jinja view the process's template cache once GE has built its environment."""

    env: Any

    def __init__(self, custom_styles_directory: str | None = None, custom_views_directory: str | None = None) -> None:
        super().__init__(custom_styles_directory, custom_views_directory)  # type: ignore[call-arg]
        self.env.bytecode_cache = TEMPLATE_CACHE


class CachedPageView(_CachedTemplates, DefaultJinjaPageView):
    """GE's page view (expectation suites, validation results) with the process's template cache."""


class CachedIndexPageView(_CachedTemplates, DefaultJinjaIndexPageView):
    """GE's index page view with the process's template cache."""


def site_views() -> dict[str, dict]:
    """The `site_section_builders` and `site_index_builder` entries of a SiteBuilder config that use these views."""
    page = {"module_name": __name__, "class_name": CachedPageView.__name__}
    index = {"module_name": __name__, "class_name": CachedIndexPageView.__name__}
    return {
        "site_section_builders": {"expectations": {"view": page}, "validations": {"view": page}},
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder", "view": index},
    }
