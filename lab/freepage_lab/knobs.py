"""Guest-side paths of the freepage kernel interfaces, in one place."""

from __future__ import annotations

# Write a page budget: one reporting pass runs now, the write returns when
# it is done (freepage series only).
FLUSH = "/sys/module/page_reporting/parameters/flush"
# virtio feature bits the guest negotiated, one '0'/'1' per bit
VIRTIO_FEATURES = "/sys/bus/virtio/devices/{dev}/features"
