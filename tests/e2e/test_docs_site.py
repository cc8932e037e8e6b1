"""The front page and the docs site: the README stays a front page (short, its commands first, every
page it links present, its YAML the preset it names), and the MkDocs site builds with no warning,
with a config reference that names every key with its description.

    mkdocs build --strict -d /tmp/site      # what the test runs (the docs extra, part of dev)
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from tests.docs_text import DOCS, README, REPO, readme, readme_blocks, readme_links
from timing import scaled

MAX_README_LINES = 200


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once with ``mkdocs build --strict``: (its folder, the build's output, seconds)."""
    try:
        import mkdocs  # noqa: F401 - optional: the docs extra, which dev includes
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("mkdocs is missing: pip install -e '.[dev]' installs the docs extra")
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about MkDocs 2, not a build warning
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                           "-d", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(120))
    return out, done, time.perf_counter() - start


def _text(page) -> str:
    """A built page's visible text: inline tags dropped, the others a space, entities read, spaces collapsed."""
    inline = re.sub(r"</?(code|strong|em|a|span)\b[^>]*>", "", page.read_text())
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", inline)).split())


def test_the_site_builds_strict_without_warnings(site):
    out, done, seconds = site
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert not re.search(r"^(WARNING|ERROR)\b", log, flags=re.M), log
    assert "Documentation built in" in log, log
    pages = {p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.rglob("*.md")}
    built = {p.parent.relative_to(out).as_posix() for p in out.rglob("index.html")}
    assert {p for p in pages if p != "index"} <= built, sorted(pages - built)  # every page became one
    print(f"mkdocs build --strict: {seconds:.1f} s")


def test_the_config_reference_names_every_key_with_its_description(site):
    sys.path.insert(0, str(DOCS))
    try:
        import gen_config_reference as reference
    finally:
        sys.path.remove(str(DOCS))
    out, done, _ = site
    assert done.returncode == 0, done.stderr
    page = out / "reference" / "config" / "index.html"
    assert page.is_file(), sorted(p.name for p in (out / "reference").iterdir())
    text = _text(page)
    keys = {path: field for _, entries in reference.walk().values() for path, field in entries}
    for key in ("train.checkpoint.save_final", "parallel.pipeline.microbatches", "model.lora.rank",
                "data.messages_field", "hardware.intra_node.bandwidth_gb_s", "parallel.pipeline.stages[i].ranks"):
        assert key in keys, key
    missing = [path for path, field in keys.items()
               if f"{path} · " not in text or " ".join(field.description.replace("`", "").split()) not in text]
    assert not missing, missing
    assert len(keys) > 150  # every section, every model and data variant
    from parallel.config import PipelineConfig
    from trainer.config.schema import CheckpointConfig

    # the two the docs point to, as a reader sees them: path · type · default · range, then the description
    for key, field in (("train.checkpoint.save_final", CheckpointConfig.model_fields["save_final"]),
                       ("parallel.pipeline.microbatches", PipelineConfig.model_fields["microbatches"])):
        facts = [key, reference.type_name(field.annotation), f"default {str(field.default).lower()}"]
        facts += [reference.bounds_text(field)] if reference.bounds_text(field) else []
        shown = field.description.replace("`", "")  # markdown: `code` renders as code, without the backticks
        assert f"{' · '.join(facts)} {shown}" in text, (key, facts)


def test_the_readme_is_a_front_page():
    lines = readme().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move the rest to docs/"
    assert lines[0] == "# Meshflow" and "Meshflow" in lines[2]  # what it is, first
    links = readme_links()
    assert len(links) >= 15 and all(link.startswith("docs/") for link in links), links
    missing = [link for link in links if not (README.parent / link).is_file()]
    assert not missing, missing


def test_the_readme_layout_is_the_preset_it_names():
    """The README's YAML is `+parallel=3d` as Hydra composes it, key for key."""
    from trainer.config.compose import compose_dict

    (block,) = readme_blocks("yaml")
    assert block[0].startswith("# conf/parallel/3d.yaml (+parallel=3d)")
    shown = yaml.safe_load("\n".join(block))
    composed = compose_dict(["+parallel=3d"])
    assert shown["mesh"] == composed["mesh"]
    for key, value in shown["parallel"].items():
        want = composed["parallel"][key]
        assert value == ({k: want[k] for k in value} if isinstance(value, dict) else want), key
