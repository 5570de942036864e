// SPDX-License-Identifier: GPL-2.0
/*
 * dirty: keep writing N MiB of anonymous memory, one byte per 4 KiB page
 * per pass, one pass every P ms (0 = back to back), for S seconds
 * (0 = until killed).  Used to give live
 * migration a working set that never stops changing.  Prints one JSON line
 * when it stops (after --seconds, or on SIGTERM/SIGINT).
 *
 *   dirty --mib N [--seconds S] [--pace-ms P]
 *
 * Exit codes: 0 ok, 2 usage error, 3 the kernel refused the memory.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "args.h"

#define MIB (1024UL * 1024UL)
#define PAGE 4096UL

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#define USAGE "dirty --mib N [--seconds S] [--pace-ms P]"

int main(int argc, char **argv)
{
	unsigned long mib = 0, len, off, passes = 0;
	double seconds = 0, pace = 0, start, next;
	unsigned char *p;
	unsigned char v = 1;
	const struct arg_spec specs[] = {
		{ "--mib", ARG_ULONG, &mib, ULONG_MAX >> 20 },
		{ "--seconds", ARG_DOUBLE, &seconds, 0 },
		{ "--pace-ms", ARG_DOUBLE, &pace, 0 },
	};
	int i;

	i = args_parse("dirty", USAGE, argc, argv, specs, ARRAY_LEN(specs));
	if (i)
		return i;
	if (!mib)
		return args_usage("dirty", USAGE, "--mib must be > 0");
	pace /= 1000.0;
	len = mib * MIB;
	p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		fprintf(stderr, "dirty: mmap %lu MiB: %s\n", mib, strerror(errno));
		return 3;
	}
	signal(SIGTERM, on_signal);
	signal(SIGINT, on_signal);
	start = now_s();
	next = start;
	while (!stop && (seconds <= 0 || now_s() - start < seconds)) {
		for (off = 0; off < len && !stop; off += PAGE)
			p[off] = v;
		v = (unsigned char)(v == 255 ? 1 : v + 1);
		passes++;
		next += pace;
		if (pace > 0 && next > now_s()) {
			double left = next - now_s();
			struct timespec ts = { (time_t)left, (long)((left - (time_t)left) * 1e9) };

			nanosleep(&ts, NULL);
		}
	}
	printf("{\"prog\":\"dirty\",\"mib\":%lu,\"passes\":%lu,\"seconds\":%.3f}\n",
	       mib, passes, now_s() - start);
	munmap(p, len);
	return 0;
}
