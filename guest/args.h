/* SPDX-License-Identifier: GPL-2.0 */
/* Numeric option values shared by the guest programs. */
#ifndef FREEPAGE_GUEST_ARGS_H
#define FREEPAGE_GUEST_ARGS_H

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/*
 * @v as a whole unsigned number (decimal, 0x hex, 0 octal) of at most
 * @max into *@out. Empty strings, signs, trailing characters and values
 * out of range are refused with a message naming @prog and @opt.
 * Returns 0, or -1 with *@out untouched.
 */
static inline int arg_ulong(const char *prog, const char *opt, const char *v,
			    unsigned long max, unsigned long *out)
{
	unsigned long n;
	char *end;

	if (v && *v >= '0' && *v <= '9') {
		errno = 0;
		n = strtoul(v, &end, 0);
		if (!errno && !*end && n <= max) {
			*out = n;
			return 0;
		}
	}
	fprintf(stderr, "%s: %s wants a number up to %lu, not '%s'\n", prog, opt, max,
		v ? v : "");
	return -1;
}

/* The same for an unsigned int */
static inline int arg_uint(const char *prog, const char *opt, const char *v, unsigned int *out)
{
	unsigned long n;

	if (arg_ulong(prog, opt, v, UINT_MAX, &n))
		return -1;
	*out = (unsigned int)n;
	return 0;
}

/* @v as a whole finite, non-negative decimal number into *@out */
static inline int arg_double(const char *prog, const char *opt, const char *v, double *out)
{
	char *end;
	double d;

	if (v && ((*v >= '0' && *v <= '9') || *v == '.')) {
		errno = 0;
		d = strtod(v, &end);
		if (!errno && !*end && isfinite(d)) {
			*out = d;
			return 0;
		}
	}
	fprintf(stderr, "%s: %s wants a number, not '%s'\n", prog, opt, v ? v : "");
	return -1;
}

#endif
