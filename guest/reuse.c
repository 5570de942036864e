// SPDX-License-Identifier: GPL-2.0
/*
 * reuse: allocate N MiB of anonymous memory, write a stamp into every
 * 4 KiB page, read every stamp back, free the memory, and again, for S
 * seconds (0 = until SIGTERM/SIGINT).  A stamp names the round and the
 * page, at the first and the last word of the page, so a page that comes
 * back with an older round's contents, another page's or zeroes counts as
 * bad.  Run through a live migration with free page hinting, it reuses
 * pages the guest has just hinted (the balloon gives them back under the
 * memory pressure this makes) and checks that what it wrote arrived.
 *
 *   reuse --mib N [--seconds S] [--pace-ms P]
 *
 * --pace-ms: a round starts at most every P ms (0 = back to back).
 * One JSON line on stdout when it stops: rounds, seconds, pages stamped,
 * bad pages and the first bad page's round, index and word.
 *
 * Exit codes: 0 every stamp read back, 1 a bad page, 2 usage error,
 * 3 the kernel refused the memory.
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
#include "clock.h"

#define MIB (1024UL * 1024UL)
#define PAGE 4096UL
#define WORDS (PAGE / sizeof(uint64_t))

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
}

static uint64_t stamp(uint64_t round, uint64_t page)
{
	return 0x5a00000000000000ULL | (round << 32) | page;
}

struct bad {
	unsigned long count;
	uint64_t round, page, word;
};

/* One round: map, stamp, check, unmap.  Returns 0 or 3 (mmap refused). */
static int one_round(unsigned long len, uint64_t round, struct bad *bad)
{
	unsigned long pages = len / PAGE, i;
	uint64_t *p;

	p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		fprintf(stderr, "reuse: mmap %lu MiB: %s\n", len / MIB, strerror(errno));
		return 3;
	}
	madvise(p, len, MADV_NOHUGEPAGE);
	for (i = 0; i < pages; i++) {
		p[i * WORDS] = stamp(round, i);
		p[i * WORDS + WORDS - 1] = stamp(round, i);
	}
	for (i = 0; i < pages; i++) {
		uint64_t want = stamp(round, i);
		uint64_t first = ((volatile uint64_t *)p)[i * WORDS];
		uint64_t last = ((volatile uint64_t *)p)[i * WORDS + WORDS - 1];

		if (first == want && last == want)
			continue;
		if (!bad->count++) {
			bad->round = round;
			bad->page = i;
			bad->word = first != want ? first : last;
		}
	}
	munmap(p, len);
	return 0;
}

#define USAGE "reuse --mib N [--seconds S] [--pace-ms P]"

int main(int argc, char **argv)
{
	unsigned long mib = 0;
	double seconds = 0, pace = 0, start, next;
	struct bad bad = { 0 };
	uint64_t round = 0;
	const struct arg_spec specs[] = {
		{ "--mib", ARG_ULONG, &mib, 1UL << 20 },
		{ "--seconds", ARG_DOUBLE, &seconds, 0 },
		{ "--pace-ms", ARG_DOUBLE, &pace, 0 },
	};
	int i, rc = 0;

	i = args_parse("reuse", USAGE, argc, argv, specs, ARRAY_LEN(specs));
	if (i)
		return i;
	if (!mib)
		return args_usage("reuse", USAGE, "--mib must be > 0");
	pace /= 1000.0;
	signal(SIGTERM, on_signal);
	signal(SIGINT, on_signal);
	start = (double)now_ns() / 1e9;
	next = start;
	while (!stop && (seconds <= 0 || (double)now_ns() / 1e9 - start < seconds)) {
		double now;

		rc = one_round(mib * MIB, round, &bad);
		if (rc)
			break;
		round++;
		next += pace;
		now = (double)now_ns() / 1e9;
		if (pace > 0 && next > now && !stop) {
			double left = next - now;
			struct timespec ts = { (time_t)left, (long)((left - (time_t)left) * 1e9) };

			nanosleep(&ts, NULL);
		}
	}
	printf("{\"prog\":\"reuse\",\"mib\":%lu,\"rounds\":%llu,\"seconds\":%.3f,"
	       "\"pages\":%llu,\"bad_pages\":%lu,\"first_bad_round\":%llu,"
	       "\"first_bad_page\":%llu,\"first_bad_word\":\"%#llx\"}\n",
	       mib, (unsigned long long)round, (double)now_ns() / 1e9 - start,
	       (unsigned long long)round * (mib * MIB / PAGE), bad.count,
	       (unsigned long long)bad.round, (unsigned long long)bad.page,
	       (unsigned long long)bad.word);
	fflush(stdout);
	if (rc)
		return rc;
	return bad.count ? 1 : 0;
}
