// SPDX-License-Identifier: GPL-2.0
/*
 * populate: fault in N MiB of anonymous memory in one of four modes, time
 * it, optionally fill it with a non-zero pattern and/or check that what the
 * kernel handed out reads as zero, then free it.  One JSON line on stdout.
 *
 *   populate --mib N [--mode 4k|thp|hugetlb|hugetlb-1g] [--fill BYTE] [--verify]
 *            [--touch] [--repeat K] [--tag TEXT]
 *
 * hugetlb uses the default huge page size, hugetlb-1g gigantic 1 GiB pages
 * (N a multiple of 1024).
 *
 * --touch times a write to every 4 KiB page right after the populate: a
 * host that discarded the memory pays its own fault there, so populate +
 * touch is the cost a program really sees.
 *
 * Exit codes: 0 ok, 1 a non-zero byte was found by --verify,
 *             2 usage error, 3 the kernel refused the memory.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>

#include "args.h"
#include "clock.h"
#include "nonzero.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MAP_HUGETLB
#define MAP_HUGETLB 0x40000
#endif
#ifndef MAP_HUGE_SHIFT
#define MAP_HUGE_SHIFT 26
#endif
#define MAP_HUGE_1GB_PAGES (30 << MAP_HUGE_SHIFT)

#define MIB (1024UL * 1024UL)

struct options {
	unsigned long mib;
	const char *mode;
	int fill;		/* -1: no fill */
	int verify;
	int touch;
	unsigned int repeat;
	const char *tag;
};

static uint64_t cpu_ns(void)
{
	struct rusage ru;

	getrusage(RUSAGE_SELF, &ru);
	return ((uint64_t)ru.ru_utime.tv_sec + (uint64_t)ru.ru_stime.tv_sec) * 1000000000ULL +
	       ((uint64_t)ru.ru_utime.tv_usec + (uint64_t)ru.ru_stime.tv_usec) * 1000ULL;
}

#define USAGE "populate --mib N [--mode 4k|thp|hugetlb|hugetlb-1g] [--fill BYTE] [--verify]\n" \
	"                [--touch] [--repeat K] [--tag TEXT]"

static int parse(int argc, char **argv, struct options *o)
{
	unsigned long fill = ULONG_MAX;
	const struct arg_spec specs[] = {
		{ "--mib", ARG_ULONG, &o->mib, ULONG_MAX >> 20 },
		{ "--mode", ARG_STRING, &o->mode, 0 },
		{ "--fill", ARG_ULONG, &fill, 0xff },
		{ "--verify", ARG_FLAG, &o->verify, 0 },
		{ "--touch", ARG_FLAG, &o->touch, 0 },
		{ "--repeat", ARG_UINT, &o->repeat, 0 },
		{ "--tag", ARG_STRING, &o->tag, 0 },
	};
	int rc;

	*o = (struct options){ .mode = "4k", .repeat = 1, .tag = "" };
	rc = args_parse("populate", USAGE, argc, argv, specs, ARRAY_LEN(specs));
	if (rc)
		return rc;
	o->fill = fill == ULONG_MAX ? -1 : (int)fill;
	if (!o->mib)
		return args_usage("populate", USAGE, "--mib must be > 0");
	if (strcmp(o->mode, "4k") && strcmp(o->mode, "thp") && strcmp(o->mode, "hugetlb") &&
	    strcmp(o->mode, "hugetlb-1g"))
		return args_usage("populate", USAGE, "--mode must be 4k, thp, hugetlb or hugetlb-1g");
	if (!strcmp(o->mode, "hugetlb-1g") && o->mib % 1024)
		return args_usage("populate", USAGE, "--mode hugetlb-1g needs --mib in whole GiB");
	if (!o->repeat)
		return args_usage("populate", USAGE, "--repeat must be > 0");
	return 0;
}


static int one_round(const struct options *o, unsigned int round)
{
	unsigned long len = o->mib * MIB;
	int flags = MAP_PRIVATE | MAP_ANONYMOUS;
	uint64_t t0, t1, t2, c0, c1, touch_ns = 0;
	unsigned long nonzero = 0;
	long f0, f1;
	void *p;

	if (!strcmp(o->mode, "hugetlb"))
		flags |= MAP_HUGETLB;
	else if (!strcmp(o->mode, "hugetlb-1g"))
		flags |= MAP_HUGETLB | MAP_HUGE_1GB_PAGES;
	p = mmap(NULL, len, PROT_READ | PROT_WRITE, flags, -1, 0);
	if (p == MAP_FAILED) {
		fprintf(stderr, "populate: mmap %lu MiB (%s): %s\n", o->mib, o->mode,
			strerror(errno));
		return 3;
	}
	if (!strcmp(o->mode, "thp"))
		madvise(p, len, MADV_HUGEPAGE);
	else if (!strcmp(o->mode, "4k"))
		madvise(p, len, MADV_NOHUGEPAGE);

	f0 = minor_faults();
	c0 = cpu_ns();
	t0 = now_ns();
	if (madvise(p, len, MADV_POPULATE_WRITE)) {
		fprintf(stderr, "populate: MADV_POPULATE_WRITE %lu MiB (%s): %s\n", o->mib,
			o->mode, strerror(errno));
		munmap(p, len);
		return 3;
	}
	t1 = now_ns();
	c1 = cpu_ns();
	f1 = minor_faults();
	if (o->touch) {
		volatile unsigned char *v = p;
		uint64_t ts = now_ns();
		unsigned long off;

		/* write what is already there: the data stays as populated */
		for (off = 0; off < len; off += 4096)
			v[off] = v[off];
		touch_ns = now_ns() - ts;
	}
	if (o->verify)
		nonzero = count_nonzero(p, len);
	t2 = now_ns();
	if (o->fill >= 0)
		memset(p, o->fill, len);
	munmap(p, len);

	printf("{\"prog\":\"populate\",\"tag\":\"%s\",\"round\":%u,\"mode\":\"%s\","
	       "\"mib\":%lu,\"populate_ns\":%llu,\"populate_cpu_ns\":%llu,"
	       "\"faults\":%ld,\"verified\":%s,\"nonzero_bytes\":%lu,\"fill_ns\":%llu,"
	       "\"touch_ns\":%llu}\n",
	       o->tag, round, o->mode, o->mib, (unsigned long long)(t1 - t0),
	       (unsigned long long)(c1 - c0), f1 - f0, o->verify ? "true" : "false",
	       nonzero, (unsigned long long)(now_ns() - t2), (unsigned long long)touch_ns);
	fflush(stdout);
	return nonzero ? 1 : 0;
}

int main(int argc, char **argv)
{
	struct options o;
	unsigned int r;
	int rc, worst = 0;

	rc = parse(argc, argv, &o);
	if (rc)
		return rc;
	for (r = 0; r < o.repeat; r++) {
		rc = one_round(&o, r);
		if (rc == 3)
			return rc;
		if (rc > worst)
			worst = rc;
	}
	return worst;
}
