"""Guest-side paths of the freepage kernel interfaces, in one place."""

from __future__ import annotations

# Write a page budget: one reporting pass runs now, the write returns when
# it is done: ENODEV without a reporting device, ENODATA if nothing was
# reported, the device's error if it failed (freepage series only).
FLUSH = "/sys/kernel/mm/page_reporting/flush"
# VIRTIO_BALLOON_F_DEVICE_INIT_REPORTED: proposed to the virtio TC
# (virtio-spec issue #244), not allocated yet
BIT_DEVICE_INIT_REPORTED = 6
# virtio feature bits the guest negotiated, one '0'/'1' per bit
VIRTIO_FEATURES = "/sys/bus/virtio/devices/{dev}/features"
# the balloon's negotiated feature string, from a guest shell
BALLOON_FEATURES = "$(cat /sys/bus/virtio/drivers/virtio_balloon/virtio*/features)"
