// SPDX-License-Identifier: GPL-2.0
/*
 * fragment: fragment physical memory the way a long-running allocator
 * does, and check every page the kernel hands out on the way. Each round
 * maps N MiB of anonymous memory (4 KiB pages, MADV_NOHUGEPAGE), faults
 * it in, frees every other block of it (MADV_DONTNEED; the block size
 * cycles through 4 KiB .. 128 KiB from round to round, so the holes are
 * of every small order), sleeps, faults the holes in again, and unmaps
 * the whole range. A freshly faulted anonymous page must read as zero:
 * every byte of every page faulted in is checked, then the page is
 * filled with a byte that changes from round to round, so that a page
 * freed by this program and handed out again without being cleared is
 * seen by whoever gets it next.
 *
 *   fragment --mib N [--seconds S] [--sleep-ms Z] [--tag TEXT]
 *
 * --seconds (default 10) is how long the rounds go on; a round that has
 * started is finished. --sleep-ms (default 100) is the pause with the
 * holes free and the pause between rounds. One JSON line on stdout.
 *
 * Exit codes: 0 ok, 1 a freshly faulted page held a non-zero byte,
 *             2 usage error, 3 the kernel refused the memory.
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
#include "nonzero.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define MIB (1024UL * 1024UL)
#define PAGE 4096UL
/* block sizes of the holes: 4 KiB << (round % BLOCK_ORDERS) */
#define BLOCK_ORDERS 6
/* non-zero pages reported on stderr, at most */
#define REPORT_MAX 8

struct options {
	unsigned long mib;
	unsigned int seconds;
	unsigned int sleep_ms;
	const char *tag;
};

struct totals {
	unsigned long rounds;
	unsigned long faulted_pages;
	unsigned long nonzero_pages;
	unsigned long nonzero_bytes;
	unsigned long holes;
};

#define USAGE "fragment --mib N [--seconds S] [--sleep-ms Z] [--tag TEXT]"

static int parse(int argc, char **argv, struct options *o)
{
	const struct arg_spec specs[] = {
		{ "--mib", ARG_ULONG, &o->mib, ULONG_MAX >> 20 },
		{ "--seconds", ARG_UINT, &o->seconds, 0 },
		{ "--sleep-ms", ARG_UINT, &o->sleep_ms, 0 },
		{ "--tag", ARG_STRING, &o->tag, 0 },
	};
	int rc;

	*o = (struct options){ .seconds = 10, .sleep_ms = 100, .tag = "" };
	rc = args_parse("fragment", USAGE, argc, argv, specs, ARRAY_LEN(specs));
	if (rc)
		return rc;
	if (!o->mib)
		return args_usage("fragment", USAGE, "--mib N is required and must be > 0");
	return 0;
}


/*
 * Fault in [p, p + len), check that every page reads as zero, fill it with
 * @fill. Returns 0, or 3 if the kernel refused the memory.
 */
static int fault_check_fill(unsigned char *p, unsigned long len, unsigned char fill,
			    struct totals *t)
{
	unsigned long off, n;

	if (madvise(p, len, MADV_POPULATE_WRITE)) {
		fprintf(stderr, "fragment: MADV_POPULATE_WRITE %lu KiB: %s\n", len >> 10,
			strerror(errno));
		return 3;
	}
	for (off = 0; off < len; off += PAGE) {
		n = count_nonzero(p + off, PAGE);
		if (n) {
			if (t->nonzero_pages < REPORT_MAX)
				fprintf(stderr, "fragment: round %lu: a fresh page held %lu "
					"non-zero bytes (first word %#llx)\n", t->rounds, n,
					(unsigned long long)*(uint64_t *)(p + off));
			t->nonzero_pages++;
			t->nonzero_bytes += n;
		}
		memset(p + off, fill, PAGE);
	}
	t->faulted_pages += len / PAGE;
	return 0;
}

/* One round; returns 0 or 3 (the kernel refused the memory) */
static int one_round(const struct options *o, struct totals *t)
{
	unsigned long len = o->mib * MIB, block = PAGE << (t->rounds % BLOCK_ORDERS), off;
	/* never 0: a page filled with zeroes would hide a stale one */
	unsigned char fill = (unsigned char)(0x11 + 0x22 * (t->rounds % 7));
	unsigned char *p;
	int rc;

	p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		fprintf(stderr, "fragment: mmap %lu MiB: %s\n", o->mib, strerror(errno));
		return 3;
	}
	madvise(p, len, MADV_NOHUGEPAGE);
	rc = fault_check_fill(p, len, fill, t);
	/* free every other block: holes between blocks that stay */
	for (off = block; !rc && off + block <= len; off += 2 * block) {
		if (madvise(p + off, block, MADV_DONTNEED)) {
			fprintf(stderr, "fragment: MADV_DONTNEED: %s\n", strerror(errno));
			rc = 3;
		}
		t->holes++;
	}
	if (!rc && o->sleep_ms)
		sleep_ms(o->sleep_ms);
	/* the holes again: whatever the kernel did with them meanwhile */
	for (off = block; !rc && off + block <= len; off += 2 * block)
		rc = fault_check_fill(p + off, block, (unsigned char)~fill, t);
	munmap(p, len);
	t->rounds++;
	return rc;
}

int main(int argc, char **argv)
{
	struct totals t = { 0 };
	struct options o;
	uint64_t start;
	int rc;

	rc = parse(argc, argv, &o);
	if (rc)
		return rc;
	start = now_ns();
	do {
		if (t.rounds && o.sleep_ms)
			sleep_ms(o.sleep_ms);
		rc = one_round(&o, &t);
	} while (!rc && now_ns() - start < (uint64_t)o.seconds * 1000000000ULL);
	printf("{\"prog\":\"fragment\",\"tag\":\"%s\",\"mib\":%lu,\"seconds\":%u,"
	       "\"sleep_ms\":%u,\"rounds\":%lu,\"holes\":%lu,\"faulted_pages\":%lu,"
	       "\"verified\":true,\"nonzero_pages\":%lu,\"nonzero_bytes\":%lu,"
	       "\"wall_ms\":%.3f}\n", o.tag, o.mib, o.seconds, o.sleep_ms, t.rounds, t.holes,
	       t.faulted_pages, t.nonzero_pages, t.nonzero_bytes,
	       (double)(now_ns() - start) / 1e6);
	fflush(stdout);
	if (rc)
		return rc;
	return t.nonzero_bytes ? 1 : 0;
}
