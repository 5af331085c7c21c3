"""``StatefulDataLoader`` as the readers' docs use it: torchdata's, imported once its one stray
warning is silenced.

torchdata 0.11's ``StatefulDataLoader.__init__`` calls ``torch.set_vital``, which torch 2.x
deprecates, so every loader built prints "'set_vital' is deprecated" about torchdata's own code:
nothing the caller does or can change. That warning, attributed to torchdata's module, is filtered
here; every other warning (yours, torch's, torchdata's) still shows.
"""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning,
                        module=r"torchdata\.")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402 - after the filter

__all__ = ["StatefulDataLoader"]
