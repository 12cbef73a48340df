"""The default deployment: what ``specbuild serve`` / ``deploy`` / ``demo`` serve when given
nothing, what the committed ``model_repo/`` holds, and what the Docker images and compose run.

It is the best exact configuration measured for the shipped reference target
(SmolLM2-135M-Instruct): ``auto`` with the packaged EAGLE-3 drafter
(``artifacts/smollm2-135m-eagle3``), whose tree also carries the n-gram lookup's match
(``speculation.eagle.merge_lookup``). The drafter is looked for, in order, in

1. the project checkout this code runs from (``<checkout>/artifacts/smollm2-135m-eagle3``);
2. the specbuild cache (``$SPECBUILD_CACHE_DIR/drafters/smollm2-135m-eagle3``), where the Docker
   images put it.

Where neither holds it (an installed wheel carries no artifacts) the default drafts with n-gram
lookup alone, and says so in the log. A folder that is there but is not an EAGLE-3 drafter is an
error, not a fallback.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from triton_backend.core.drafter_format import EagleFormat, detect_eagle_format
from triton_backend.core.errors import ConfigError
from triton_backend.core.reference_model import cache_dir
from triton_backend.deployment.deployment_config import DeploymentConfig

logger = logging.getLogger(__name__)

REFERENCE_DRAFTER = "smollm2-135m-eagle3"  # the EAGLE-3 drafter trained for the reference target
CHECKOUT_ROOT = Path(__file__).resolve().parents[2]  # the folder holding builder/ (and, in a checkout, artifacts/)
ARTIFACTS_DIR = "artifacts"
CACHE_DRAFTERS_DIR = "drafters"  # under cache_dir(): where the images put the drafter


def drafter_search_paths() -> list[Path]:
    """Where the reference drafter is looked for, in order."""
    return [CHECKOUT_ROOT / ARTIFACTS_DIR / REFERENCE_DRAFTER, cache_dir() / CACHE_DRAFTERS_DIR / REFERENCE_DRAFTER]


def find_reference_drafter(search: Sequence[Path] | None = None) -> Path | None:
    """The first of ``search`` (default :func:`drafter_search_paths`) that exists, checked to be an
    EAGLE-3 drafter folder; ``None`` when none exists."""
    for path in drafter_search_paths() if search is None else search:
        if not path.exists():
            continue
        if not path.is_dir() or detect_eagle_format(path) is not EagleFormat.EAGLE3:
            raise ConfigError(f"{path} is where the default deployment's EAGLE-3 drafter belongs, but it is not an "
                              "EAGLE-3 drafter folder (config.json naming the EAGLE-3 architecture)")
        return path.resolve()
    return None


def _written_path(drafter: Path, relative_to: Path | None) -> str:
    """The drafter's path as the deployment file holds it: relative to ``relative_to`` (the folder
    the deployment file is written into) when that folder lies under the tree holding the drafter
    (the committed ``model_repo/`` beside ``artifacts/``: the checkout stays movable), else absolute.
    Relative paths in a deployment file are read relative to the file (``load_deployment``)."""
    if relative_to is not None:
        root = drafter.parent.parent
        anchor = relative_to.resolve()
        if anchor.is_relative_to(root):
            return Path(os.path.relpath(drafter, anchor)).as_posix()
    return str(drafter)


def default_deployment(relative_to: Path | None = None, search: Sequence[Path] | None = None) -> DeploymentConfig:
    """The reference target, ``auto`` with the packaged EAGLE-3 drafter merged with n-gram lookup;
    n-gram lookup alone when the drafter is not found (logged). ``relative_to``: the folder the
    deployment file will be written into (see :func:`_written_path`); ``search``: where to look for
    the drafter (default :func:`drafter_search_paths`)."""
    paths = drafter_search_paths() if search is None else list(search)
    drafter = find_reference_drafter(paths)
    if drafter is None:
        logger.warning("default deployment: no EAGLE-3 drafter found (looked in %s): drafting with n-gram lookup "
                       "only", ", ".join(map(str, paths)))
        return DeploymentConfig()
    deployment = DeploymentConfig(eagle=str(drafter), eagle_format=EagleFormat.EAGLE3)
    logger.info("default deployment: %s", describe_drafters(deployment))
    return replace(deployment, eagle=_written_path(drafter, relative_to))


def _shown(path: str) -> str:
    """A drafter path as a person reads it: relative to the working folder when under it."""
    p = Path(path)
    if p.is_absolute():
        try:
            return p.relative_to(Path.cwd()).as_posix()
        except ValueError:
            return path
    return path


def describe_drafters(deployment: DeploymentConfig) -> str:
    """What drafts by default, e.g. ``auto: EAGLE-3 drafter artifacts/smollm2-135m-eagle3 + n-gram
    lookup (merged into one tree)``."""
    speculation = deployment.speculation
    parts = []
    if deployment.eagle is not None:
        label = "EAGLE-3" if deployment.resolved_eagle_format() is EagleFormat.EAGLE3 else "EAGLE-1"
        parts.append(f"{label} drafter {_shown(deployment.eagle)}")
    if deployment.medusa is not None:
        parts.append(f"Medusa heads {_shown(deployment.medusa)}")
    if deployment.self_draft is not None:
        parts.append(f"self draft ({deployment.self_draft.label()})")
    elif deployment.draft is not None:
        parts.append(f"draft model {_shown(deployment.draft)}")
    elif deployment.draft_layers is not None:
        parts.append(f"draft of target layers {list(deployment.draft_layers)}")
    if deployment.ngram:
        merged = deployment.eagle is not None and speculation.eagle.merge_lookup and speculation.eagle.tree
        parts.append("n-gram lookup" + (" (merged into one tree)" if merged else ""))
    return f"{speculation.method.value}: " + (" + ".join(parts) if parts else "no drafter (plain decoding)")


__all__ = ["CACHE_DRAFTERS_DIR", "REFERENCE_DRAFTER", "default_deployment", "describe_drafters",
           "drafter_search_paths", "find_reference_drafter"]
