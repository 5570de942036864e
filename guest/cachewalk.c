// SPDX-License-Identifier: GPL-2.0
/*
 * cachewalk: a cache-sensitive workload.  Chases pointers through a random
 * cycle over a working set of N KiB, one 64-byte line per step, in bursts:
 * B ms of walking, then Z ms asleep, for S seconds.  One JSON line on
 * stdout at the end.
 *
 *   cachewalk --kib N [--seconds S] [--busy-ms B] [--sleep-ms Z] [--tag TEXT]
 *
 * Sized to the last-level cache, the walk hits in it as long as nothing
 * else evicts its lines.  Whatever runs while it sleeps (on a
 * uniprocessor guest, a SCHED_IDLE thread runs exactly then) and writes
 * through the cache pushes the working set out, and the walk pays the
 * misses when it wakes up: the first pass over the working set after each
 * sleep ("refill", cut short if the burst ends first) shows it most, the
 * whole burst ("walk") is what the workload loses.  Reported: median ns per access over the bursts, of the
 * refill pass and of the whole burst, and their means.
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
#include <time.h>

#include "args.h"
#include "clock.h"

#define LINE 64UL
#define CHECK_EVERY 4096UL	/* steps between two looks at the clock */
#define MAX_BURSTS 100000UL

struct options {
	unsigned long kib;
	double seconds;
	unsigned long busy_ms;
	unsigned long sleep_ms;
	const char *tag;
};

/* one cache line: the index of the next line of the cycle, padding */
struct line {
	unsigned long next;
	unsigned long pad[LINE / sizeof(unsigned long) - 1];
};

#define USAGE "cachewalk --kib N [--seconds S] [--busy-ms B] [--sleep-ms Z] [--tag TEXT]"

static int parse(int argc, char **argv, struct options *o)
{
	const struct arg_spec specs[] = {
		{ "--kib", ARG_ULONG, &o->kib, ULONG_MAX >> 10 },
		{ "--seconds", ARG_DOUBLE, &o->seconds, 0 },
		{ "--busy-ms", ARG_ULONG, &o->busy_ms, ULONG_MAX },
		{ "--sleep-ms", ARG_ULONG, &o->sleep_ms, ULONG_MAX },
		{ "--tag", ARG_STRING, &o->tag, 0 },
	};
	int rc;

	*o = (struct options){ .seconds = 10, .busy_ms = 10, .sleep_ms = 10, .tag = "" };
	rc = args_parse("cachewalk", USAGE, argc, argv, specs, ARRAY_LEN(specs));
	if (rc)
		return rc;
	if (o->kib < 4)
		return args_usage("cachewalk", USAGE, "--kib must be >= 4");
	if (!(o->seconds > 0))
		return args_usage("cachewalk", USAGE, "--seconds must be > 0");
	if (!o->busy_ms)
		return args_usage("cachewalk", USAGE, "--busy-ms must be > 0");
	return 0;
}

/* A single random cycle through all n lines (Sattolo's shuffle). */
static void link_cycle(struct line *l, unsigned long n)
{
	unsigned long *order = malloc(n * sizeof(*order));
	unsigned long i, seed = 88172645463325252UL;

	if (!order) {
		for (i = 0; i < n; i++)
			l[i].next = (i + 1) % n;
		return;
	}
	for (i = 0; i < n; i++)
		order[i] = i;
	for (i = n - 1; i > 0; i--) {
		unsigned long j, t;

		seed ^= seed << 13;
		seed ^= seed >> 7;
		seed ^= seed << 17;
		j = seed % i;
		t = order[i];
		order[i] = order[j];
		order[j] = t;
	}
	for (i = 0; i < n; i++)
		l[order[i]].next = order[(i + 1) % n];
	free(order);
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

static double median(double *v, unsigned long n)
{
	if (!n)
		return 0;
	qsort(v, n, sizeof(*v), cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv)
{
	static double refill[MAX_BURSTS], walk[MAX_BURSTS];
	struct timespec nap;
	struct options o;
	unsigned long n, cur = 0, bursts = 0, i;
	uint64_t start, end, accesses = 0, busy_ns = 0;
	double refill_sum = 0, walk_sum = 0;
	struct line *l;
	int rc;

	rc = parse(argc, argv, &o);
	if (rc)
		return rc;
	n = o.kib * 1024 / LINE;
	l = mmap(NULL, n * LINE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (l == MAP_FAILED) {
		fprintf(stderr, "cachewalk: mmap %lu KiB: %s\n", o.kib, strerror(errno));
		return 3;
	}
	link_cycle(l, n);
	/* warm: two passes, so the first burst starts from a cached working set */
	for (i = 0; i < 2 * n; i++)
		cur = l[cur].next;

	nap.tv_sec = o.sleep_ms / 1000;
	nap.tv_nsec = (long)(o.sleep_ms % 1000) * 1000000L;
	start = now_ns();
	end = start + (uint64_t)(o.seconds * 1e9);
	while (bursts < MAX_BURSTS) {
		uint64_t t0 = now_ns(), t1, t2, deadline = t0 + o.busy_ms * 1000000ULL;
		unsigned long steps = 0, first = 0;

		if (t0 >= end)
			break;
		/* the refill pass: one full cycle right after the sleep, or as
		 * much of it as the burst allows */
		do {
			for (i = 0; i < CHECK_EVERY && first < n; i++, first++)
				cur = l[cur].next;
			t1 = now_ns();
		} while (first < n && t1 < deadline);
		/* then walk on until the burst is over */
		t2 = t1;
		while (t2 < deadline) {
			for (i = 0; i < CHECK_EVERY; i++)
				cur = l[cur].next;
			steps += CHECK_EVERY;
			t2 = now_ns();
		}
		refill[bursts] = (double)(t1 - t0) / (double)first;
		walk[bursts] = (double)(t2 - t0) / (double)(first + steps);
		refill_sum += refill[bursts];
		walk_sum += walk[bursts];
		accesses += first + steps;
		busy_ns += t2 - t0;
		bursts++;
		if (o.sleep_ms)
			nanosleep(&nap, NULL);
	}
	end = now_ns();

	printf("{\"prog\":\"cachewalk\",\"tag\":\"%s\",\"kib\":%lu,\"busy_ms\":%lu,"
	       "\"sleep_ms\":%lu,\"bursts\":%lu,\"accesses\":%llu,\"busy_ns\":%llu,"
	       "\"wall_ns\":%llu,\"refill_ns_per_access_median\":%.3f,"
	       "\"refill_ns_per_access_mean\":%.3f,\"walk_ns_per_access_median\":%.3f,"
	       "\"walk_ns_per_access_mean\":%.3f,\"sink\":%lu}\n",
	       o.tag, o.kib, o.busy_ms, o.sleep_ms, bursts, (unsigned long long)accesses,
	       (unsigned long long)busy_ns, (unsigned long long)(end - start),
	       median(refill, bursts), bursts ? refill_sum / (double)bursts : 0,
	       median(walk, bursts), bursts ? walk_sum / (double)bursts : 0, cur);
	munmap(l, n * LINE);
	return 0;
}
