// SPDX-License-Identifier: GPL-2.0
/*
 * pagefault: a page_fault1-style microbenchmark (as in will-it-scale):
 * for S seconds, map N MiB of anonymous memory, write one byte per 4 KiB
 * page, unmap it, and count the faults. One JSON line on stdout.
 *
 *   pagefault [--seconds S] [--mib N] [--tag TEXT]
 *
 * --seconds defaults to 10, --mib to 128. Pages are 4 KiB
 * (MADV_NOHUGEPAGE): every write is one page fault.
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

#define USAGE "pagefault [--seconds S] [--mib N] [--tag TEXT]"

int main(int argc, char **argv)
{
	unsigned long mib = 128, seconds = 10, len, off, iterations = 0, pages = 0;
	const char *tag = "";
	uint64_t start, end, deadline, elapsed;
	long f0, faults;
	const struct arg_spec specs[] = {
		{ "--seconds", ARG_ULONG, &seconds, ULONG_MAX },
		{ "--mib", ARG_ULONG, &mib, ULONG_MAX >> 20 },
		{ "--tag", ARG_STRING, &tag, 0 },
	};
	int i;

	i = args_parse("pagefault", USAGE, argc, argv, specs, ARRAY_LEN(specs));
	if (i)
		return i;
	if (!mib || !seconds)
		return args_usage("pagefault", USAGE, "--mib and --seconds must be > 0");
	len = mib * MIB;
	f0 = minor_faults();
	start = now_ns();
	deadline = start + (uint64_t)seconds * 1000000000ULL;
	do {
		volatile unsigned char *v;
		void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
			       -1, 0);

		if (p == MAP_FAILED) {
			fprintf(stderr, "pagefault: mmap %lu MiB: %s\n", mib, strerror(errno));
			return 3;
		}
		madvise(p, len, MADV_NOHUGEPAGE);
		v = p;
		for (off = 0; off < len; off += PAGE)
			v[off] = 1;
		munmap(p, len);
		iterations++;
		pages += len / PAGE;
		end = now_ns();
	} while (end < deadline);
	faults = minor_faults() - f0;
	elapsed = end - start;
	printf("{\"prog\":\"pagefault\",\"tag\":\"%s\",\"mib\":%lu,\"seconds\":%.3f,"
	       "\"iterations\":%lu,\"pages\":%lu,\"faults\":%ld,\"faults_per_s\":%.1f,"
	       "\"pages_per_s\":%.1f}\n", tag, mib, (double)elapsed / 1e9, iterations, pages,
	       faults, (double)faults * 1e9 / (double)elapsed, (double)pages * 1e9 / (double)elapsed);
	fflush(stdout);
	return 0;
}
