"""Where each replica runs: `--replica MODEL=URL@REGION` (the same text in `TOLLGATE_REPLICAS`
and the file's `replicas = [...]`), the `region` setting for a replica given none, and
`simulated_regions` for the simulated fleet. The router confines pinned tenants to them
(`domain.residency`).

The region is what follows the URL's last `@`, when what precedes it is a whole URL
(`scheme://host...`). A replica URL never carries user information (vLLM takes its key as a
bearer token), so `http://10.0.0.5:8000@eu-west` can mean nothing else.
"""

from __future__ import annotations

from tollgate_llm.domain.control_plane.data_policy import check_region
from tollgate_llm.domain.errors import DomainError

__all__ = ["simulated_region", "split_region"]


def split_region(value: str, default: str = "") -> tuple[str, str]:
    """(url, region) of a `--replica` value's URL part; `default` when it names no region. A
    region that is not a region name is refused, naming the flag."""
    url, at, region = value.rpartition("@")
    if not at or "://" not in url or not url.split("://", 1)[1]:
        return value, default
    try:
        check_region(region, "--replica")
    except DomainError as exc:
        raise ValueError(f"--replica {value!r}: {exc.message}") from None
    return url, region


def simulated_region(regions: tuple[str, ...], index: int, default: str = "") -> str:
    """The region of a model's `index`-th simulated replica: the regions in turn (none given:
    `default`)."""
    return regions[index % len(regions)] if regions else default
