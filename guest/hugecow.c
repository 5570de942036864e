// SPDX-License-Identifier: GPL-2.0
/*
 * hugecow: take 2 MiB hugetlb folios from the pool both ways, by faults
 * that clear them and by a copy-on-write that overwrites them.
 *
 * Maps N private hugetlb pages and writes each (N faults), unmaps the
 * last one (its folio goes back to the pool, dirty), forks, and lets the
 * child write the first page (a copy-on-write in the child, which owns
 * no reservation). The child exits, then the parent unmaps everything.
 * Which free folio the copy-on-write took shows afterwards in how many
 * dirty folios the pool holds. Prints one JSON line.
 *
 *   hugecow --pages N
 *
 * Exit codes: 0 ok, 1 a step failed (the JSON line says which), 2 usage.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "args.h"

#define HUGE (2UL * 1024UL * 1024UL)

#ifndef MAP_HUGETLB
#define MAP_HUGETLB 0x40000
#endif

#define USAGE "hugecow --pages N"

static int fail(const char *step, int err)
{
	printf("{\"prog\":\"hugecow\",\"ok\":false,\"step\":\"%s\",\"error\":\"%s\"}\n",
	       step, strerror(err));
	return 1;
}

int main(int argc, char **argv)
{
	unsigned long pages = 0, i;
	int status;
	char *p;
	pid_t pid;
	const struct arg_spec specs[] = {
		{ "--pages", ARG_ULONG, &pages, 1024UL },
	};

	i = args_parse("hugecow", USAGE, argc, argv, specs, ARRAY_LEN(specs));
	if (i)
		return i;
	if (pages < 2)
		return args_usage("hugecow", USAGE, "--pages must be at least 2");

	p = mmap(NULL, pages * HUGE, PROT_READ | PROT_WRITE,
		 MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
	if (p == MAP_FAILED)
		return fail("mmap", errno);
	for (i = 0; i < pages; i++)
		memset(p + i * HUGE, 0x5a, HUGE);
	if (munmap(p + (pages - 1) * HUGE, HUGE))
		return fail("munmap", errno);

	fflush(stdout);
	pid = fork();
	if (pid < 0)
		return fail("fork", errno);
	if (!pid) {
		/* copy-on-write: a SIGBUS here if the pool had no folio */
		p[0] = 0x11;
		_exit(p[1] == 0x5a ? 0 : 3);
	}
	if (waitpid(pid, &status, 0) < 0)
		return fail("waitpid", errno);
	if (!WIFEXITED(status) || WEXITSTATUS(status))
		return fail("copy-on-write", ECHILD);
	munmap(p, (pages - 1) * HUGE);

	printf("{\"prog\":\"hugecow\",\"ok\":true,\"pages\":%lu}\n", pages);
	return 0;
}
