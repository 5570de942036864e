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


def flush_cmd(pages: int = 1000000) -> str:
    """Guest shell: report up to `pages` free pages now and wait for it.

    ENODATA means a pass had already reported everything (the series
    reports within 100 ms of a free), which is fine; any other error (no
    device, the device failed) ends the script.
    """
    return (f'out=$( (echo {pages} > {FLUSH}) 2>&1 ) || case "$out" in '
            f'*"No data available"*) ;; *) echo "flush: $out" >&2; exit 1;; esac')
