"""MkDocs hooks (``hooks:`` in mkdocs.yml): the config reference page is generated at every build.

``docs/gen_config_reference.py`` walks the pydantic config models; the page is added to the site's
files here, never written into the checkout, so it always says what the code says.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.structure.files import File, Files

_SPEC = importlib.util.spec_from_file_location("gen_config_reference",
                                               Path(__file__).with_name("gen_config_reference.py"))
reference = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(reference)


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, reference.PAGE, content=reference.render()))
    return files
