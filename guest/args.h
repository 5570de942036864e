/* SPDX-License-Identifier: GPL-2.0 */
/* Options of the guest programs: a table per program, values checked. */
#ifndef FREEPAGE_GUEST_ARGS_H
#define FREEPAGE_GUEST_ARGS_H

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* What an option of a program's table takes */
enum arg_kind {
	ARG_FLAG,	/* no value: sets the int at @out to 1 */
	ARG_ULONG,	/* unsigned long of at most @max */
	ARG_UINT,	/* unsigned int */
	ARG_DOUBLE,	/* finite, non-negative double */
	ARG_STRING,	/* const char *, the argument itself */
};

struct arg_spec {
	const char *name;	/* "--mib" */
	enum arg_kind kind;
	void *out;
	unsigned long max;	/* ARG_ULONG only */
};

/* "@prog: @why" and the usage line on stderr; returns 2, the exit code */
static inline int args_usage(const char *prog, const char *usage, const char *why)
{
	fprintf(stderr, "%s: %s\nusage: %s\n", prog, why, usage);
	return 2;
}

/*
 * Every argument of @argv as one option of the @n in @specs, each value
 * checked as its kind says. Returns 0, or 2 after a message naming the
 * option (unknown, without its value, or a value refused).
 */
static inline int args_parse(const char *prog, const char *usage, int argc, char **argv,
			     const struct arg_spec *specs, size_t n)
{
	int i;

	for (i = 1; i < argc; i++) {
		const struct arg_spec *s = NULL;
		const char *v;
		size_t k;
		int bad;

		for (k = 0; k < n && !s; k++)
			if (!strcmp(argv[i], specs[k].name))
				s = &specs[k];
		if (!s) {
			fprintf(stderr, "%s: unknown option '%s'\nusage: %s\n", prog, argv[i],
				usage);
			return 2;
		}
		if (s->kind == ARG_FLAG) {
			*(int *)s->out = 1;
			continue;
		}
		if (i + 1 >= argc) {
			fprintf(stderr, "%s: %s needs a value\nusage: %s\n", prog, s->name, usage);
			return 2;
		}
		v = argv[++i];
		switch (s->kind) {
		case ARG_ULONG:
			bad = arg_ulong(prog, s->name, v, s->max, s->out);
			break;
		case ARG_UINT:
			bad = arg_uint(prog, s->name, v, s->out);
			break;
		case ARG_DOUBLE:
			bad = arg_double(prog, s->name, v, s->out);
			break;
		default:
			*(const char **)s->out = v;
			bad = 0;
		}
		if (bad)
			return 2;
	}
	return 0;
}

#endif
