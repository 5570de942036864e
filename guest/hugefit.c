// SPDX-License-Identifier: GPL-2.0
/*
 * hugefit: map N MiB of 2 MiB hugetlb memory and unmap it again, once a
 * millisecond for T ms, without touching it: each mmap() asks the pool for
 * a reservation of N MiB, and between two the pool holds none. With a pool of exactly N MiB, every one of them
 * must succeed while the pool's folios are free, whatever the kernel does
 * with free folios meanwhile (pre-zeroing). Prints one JSON line with the
 * tries and the refusals.
 *
 *   hugefit --mib N --ms T
 *
 * Exit codes: 0 ok (refusals are data, in the JSON line), 2 usage error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "args.h"
#include "clock.h"

#define MIB (1024UL * 1024UL)

#ifndef MAP_HUGETLB
#define MAP_HUGETLB 0x40000
#endif

#define USAGE "hugefit --mib N --ms T"

int main(int argc, char **argv)
{
	unsigned long mib = 0, ms = 0, tries = 0, refused = 0;
	int first_errno = 0;
	uint64_t end;
	const struct arg_spec specs[] = {
		{ "--mib", ARG_ULONG, &mib, 1UL << 20 },
		{ "--ms", ARG_ULONG, &ms, 3600000UL },
	};
	int i;

	i = args_parse("hugefit", USAGE, argc, argv, specs, ARRAY_LEN(specs));
	if (i)
		return i;
	if (!mib || mib % 2)
		return args_usage("hugefit", USAGE, "--mib must be a positive multiple of 2");

	end = now_ns() + ms * 1000000ULL;
	do {
		void *p = mmap(NULL, mib * MIB, PROT_READ | PROT_WRITE,
			       MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);

		tries++;
		if (p == MAP_FAILED) {
			refused++;
			if (!first_errno)
				first_errno = errno;
		} else {
			munmap(p, mib * MIB);
		}
		usleep(1000);
	} while (now_ns() < end);

	printf("{\"prog\":\"hugefit\",\"mib\":%lu,\"ms\":%lu,\"tries\":%lu,\"refused\":%lu,"
	       "\"error\":\"%s\"}\n", mib, ms, tries, refused,
	       first_errno ? strerror(first_errno) : "");
	return 0;
}
