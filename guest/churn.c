// SPDX-License-Identifier: GPL-2.0
/*
 * churn: allocate and free the same amount of anonymous memory over and
 * over, the way a batch job or a garbage collector does, and time it.
 * Each iteration maps N MiB, writes one byte per 4 KiB page (every page is
 * faulted in), and unmaps it again. One JSON line on stdout with the
 * alloc + touch time and the minor faults of every iteration.
 *
 *   churn [--mib N] [--iterations K] [--sleep-ms S] [--thp] [--tag TEXT]
 *
 * --mib defaults to 512, --iterations to 10, --sleep-ms (between
 * iterations) to 0. Pages are 4 KiB (MADV_NOHUGEPAGE) unless --thp.
 *
 * Exit codes: 0 ok, 2 usage error, 3 the kernel refused the memory.
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

#define MIB (1024UL * 1024UL)
#define PAGE 4096UL
#define MAX_ITERATIONS 10000

struct options {
	unsigned long mib;
	unsigned int iterations;
	unsigned int sleep_ms;
	int thp;
	const char *tag;
};

#define USAGE "churn [--mib N] [--iterations K] [--sleep-ms S] [--thp] [--tag TEXT]"

static int parse(int argc, char **argv, struct options *o)
{
	const struct arg_spec specs[] = {
		{ "--mib", ARG_ULONG, &o->mib, ULONG_MAX >> 20 },
		{ "--iterations", ARG_UINT, &o->iterations, 0 },
		{ "--sleep-ms", ARG_UINT, &o->sleep_ms, 0 },
		{ "--thp", ARG_FLAG, &o->thp, 0 },
		{ "--tag", ARG_STRING, &o->tag, 0 },
	};
	int rc;

	*o = (struct options){ .mib = 512, .iterations = 10, .tag = "" };
	rc = args_parse("churn", USAGE, argc, argv, specs, ARRAY_LEN(specs));
	if (rc)
		return rc;
	if (!o->mib)
		return args_usage("churn", USAGE, "--mib must be > 0");
	if (!o->iterations || o->iterations > MAX_ITERATIONS)
		return args_usage("churn", USAGE, "--iterations must be 1..10000");
	return 0;
}


/* Map, touch every page, unmap. Returns 0 or 3 (mmap refused). */
static int one_iteration(const struct options *o, uint64_t *alloc_ns, uint64_t *free_ns,
			 long *faults)
{
	unsigned long len = o->mib * MIB, off;
	volatile unsigned char *v;
	uint64_t t0, t1, t2;
	long f0;
	void *p;

	f0 = minor_faults();
	t0 = now_ns();
	p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		fprintf(stderr, "churn: mmap %lu MiB: %s\n", o->mib, strerror(errno));
		return 3;
	}
	madvise(p, len, o->thp ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
	v = p;
	for (off = 0; off < len; off += PAGE)
		v[off] = 1;
	t1 = now_ns();
	*faults = minor_faults() - f0;
	munmap(p, len);
	t2 = now_ns();
	*alloc_ns = t1 - t0;
	*free_ns = t2 - t1;
	return 0;
}

static void print_array_ms(const char *key, const uint64_t *ns, unsigned int n)
{
	unsigned int i;

	printf(",\"%s\":[", key);
	for (i = 0; i < n; i++)
		printf("%s%.3f", i ? "," : "", (double)ns[i] / 1e6);
	printf("]");
}

int main(int argc, char **argv)
{
	static uint64_t alloc_ns[MAX_ITERATIONS], free_ns[MAX_ITERATIONS];
	static long faults[MAX_ITERATIONS];
	uint64_t start, total_alloc = 0;
	long total_faults = 0;
	struct options o;
	unsigned int i;
	int rc;

	rc = parse(argc, argv, &o);
	if (rc)
		return rc;
	start = now_ns();
	for (i = 0; i < o.iterations; i++) {
		if (i && o.sleep_ms)
			sleep_ms(o.sleep_ms);
		rc = one_iteration(&o, &alloc_ns[i], &free_ns[i], &faults[i]);
		if (rc)
			return rc;
		total_alloc += alloc_ns[i];
		total_faults += faults[i];
	}
	printf("{\"prog\":\"churn\",\"tag\":\"%s\",\"mib\":%lu,\"iterations\":%u,"
	       "\"sleep_ms\":%u,\"thp\":%s", o.tag, o.mib, o.iterations, o.sleep_ms,
	       o.thp ? "true" : "false");
	print_array_ms("alloc_ms", alloc_ns, o.iterations);
	print_array_ms("free_ms", free_ns, o.iterations);
	printf(",\"faults\":[");
	for (i = 0; i < o.iterations; i++)
		printf("%s%ld", i ? "," : "", faults[i]);
	printf("],\"total_alloc_ms\":%.3f,\"total_faults\":%ld,\"wall_ms\":%.3f}\n",
	       (double)total_alloc / 1e6, total_faults, (double)(now_ns() - start) / 1e6);
	fflush(stdout);
	return 0;
}
