/* SPDX-License-Identifier: GPL-2.0 */
/* Counting what is not zero, shared by the guest programs. */
#ifndef FREEPAGE_GUEST_NONZERO_H
#define FREEPAGE_GUEST_NONZERO_H

#include <stdint.h>

/* Non-zero bytes in the @len bytes at @p (8-byte aligned, @len a multiple of 8) */
static inline unsigned long count_nonzero(const unsigned char *p, unsigned long len)
{
	const uint64_t *w = (const uint64_t *)p;
	unsigned long i, n = 0;
	unsigned int b;

	for (i = 0; i < len / 8; i++) {
		if (!w[i])
			continue;
		for (b = 0; b < 8; b++)
			n += p[i * 8 + b] != 0;
	}
	return n;
}

#endif
