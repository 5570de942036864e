// SPDX-License-Identifier: GPL-2.0
/*
 * fpkeep: the kernel keeps each process's vector registers, across
 * system calls, context switches and fork. UML saves and restores them
 * through the host's ptrace on every switch to the kernel, in a buffer
 * sized from the host's XSAVE area: a buffer that is short, shared or
 * not copied at fork shows here as a register that changed under a
 * process.
 *
 *   fpkeep [--procs P] [--rounds R] [--tag TEXT]
 *
 * P processes (default 4) run at once, each with a pattern of its own in
 * eight vector registers (x86_64: xmm8-xmm15; arm64: v8-v15): a round
 * loads the pattern, yields the CPU with a raw sched_yield (nothing of
 * the C library runs between the load and the check) and checks every
 * register; R rounds each (default 20000). Before that, a process loads
 * a pattern, forks with a raw system call, and the child checks that it
 * got the registers as they were. One JSON line on stdout.
 *
 * Exit codes: 0 ok, 1 a register changed, 2 usage error, 3 fork failed.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "args.h"

#define REGS 8
#define MAX_PROCS 64

struct options {
	unsigned int procs;
	unsigned long rounds;
	const char *tag;
};

#define USAGE "fpkeep [--procs P] [--rounds R] [--tag TEXT]"

/* 16 bytes per register */
struct bank {
	uint64_t w[REGS][2];
} __attribute__((aligned(16)));

#if defined(__x86_64__)
#define LOAD								\
	"movdqu 0(%[in]), %%xmm8\n\tmovdqu 16(%[in]), %%xmm9\n\t"	\
	"movdqu 32(%[in]), %%xmm10\n\tmovdqu 48(%[in]), %%xmm11\n\t"	\
	"movdqu 64(%[in]), %%xmm12\n\tmovdqu 80(%[in]), %%xmm13\n\t"	\
	"movdqu 96(%[in]), %%xmm14\n\tmovdqu 112(%[in]), %%xmm15\n\t"
#define STORE								\
	"movdqu %%xmm8, 0(%[out])\n\tmovdqu %%xmm9, 16(%[out])\n\t"	\
	"movdqu %%xmm10, 32(%[out])\n\tmovdqu %%xmm11, 48(%[out])\n\t"	\
	"movdqu %%xmm12, 64(%[out])\n\tmovdqu %%xmm13, 80(%[out])\n\t"	\
	"movdqu %%xmm14, 96(%[out])\n\tmovdqu %%xmm15, 112(%[out])\n\t"
#define VREGS "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"

/* load, a system call (number in rax, rdi first argument), store; rax: result */
static long around_syscall(const struct bank *in, struct bank *out, long nr, long a0)
{
	register long rax __asm__("rax") = nr;
	register long rdi __asm__("rdi") = a0;

	__asm__ volatile(LOAD "syscall\n\t" STORE
			 : "+r"(rax)
			 : [in] "r"(in), [out] "r"(out), "r"(rdi)
			 : "rcx", "r11", "rsi", "rdx", "r8", "r9", "r10", "memory", VREGS);
	return rax;
}
#define NR_FORK_ARG0 0
#define NR_FORK SYS_fork
#elif defined(__aarch64__)
#define LOAD								\
	"ldp q8, q9, [%[in]]\n\tldp q10, q11, [%[in], 32]\n\t"	\
	"ldp q12, q13, [%[in], 64]\n\tldp q14, q15, [%[in], 96]\n\t"
#define STORE								\
	"stp q8, q9, [%[out]]\n\tstp q10, q11, [%[out], 32]\n\t"	\
	"stp q12, q13, [%[out], 64]\n\tstp q14, q15, [%[out], 96]\n\t"
#define VREGS "v8", "v9", "v10", "v11", "v12", "v13", "v14", "v15"

static long around_syscall(const struct bank *in, struct bank *out, long nr, long a0)
{
	register long x8 __asm__("x8") = nr;
	register long x0 __asm__("x0") = a0;
	register long x1 __asm__("x1") = 0;
	register long x2 __asm__("x2") = 0;
	register long x3 __asm__("x3") = 0;
	register long x4 __asm__("x4") = 0;

	__asm__ volatile(LOAD "svc 0\n\t" STORE
			 : "+r"(x0)
			 : [in] "r"(in), [out] "r"(out), "r"(x8), "r"(x1), "r"(x2), "r"(x3),
			   "r"(x4)
			 : "memory", VREGS);
	return x0;
}
/* arm64 has no fork: clone(SIGCHLD, no new stack) */
#define NR_FORK_ARG0 17
#define NR_FORK SYS_clone
#else
#error "fpkeep: x86_64 and arm64 only"
#endif

static void fill(struct bank *b, uint64_t seed)
{
	for (int i = 0; i < REGS; i++) {
		b->w[i][0] = seed * 0x9e3779b97f4a7c15ULL + (uint64_t)i;
		b->w[i][1] = ~b->w[i][0] ^ ((uint64_t)i << 56);
	}
}

/* registers that differ, reported on stderr */
static int differ(const char *what, const struct bank *want, const struct bank *got)
{
	int bad = 0;

	for (int i = 0; i < REGS; i++) {
		if (!memcmp(want->w[i], got->w[i], sizeof(want->w[i])))
			continue;
		fprintf(stderr, "fpkeep: %s: register %d is %016llx%016llx, not %016llx%016llx\n",
			what, 8 + i, (unsigned long long)got->w[i][1],
			(unsigned long long)got->w[i][0], (unsigned long long)want->w[i][1],
			(unsigned long long)want->w[i][0]);
		bad++;
	}
	return bad;
}

/* 0 if the child saw the registers as they were at fork, 1 if not, 3 if fork failed */
static int fork_keeps(void)
{
	struct bank in, out;
	long pid;
	int status;

	fill(&in, 0xf0f0);
	memset(&out, 0, sizeof(out));
	pid = around_syscall(&in, &out, NR_FORK, NR_FORK_ARG0);
	if (pid == 0)
		_exit(differ("after fork, in the child", &in, &out) ? 1 : 0);
	if (pid < 0)
		return 3;
	if (waitpid((pid_t)pid, &status, 0) < 0 || !WIFEXITED(status))
		return 1;
	return WEXITSTATUS(status) || differ("after fork, in the parent", &in, &out) ? 1 : 0;
}

/* the number of rounds whose registers came back changed */
static unsigned long yield_keeps(unsigned int id, unsigned long rounds)
{
	struct bank in, out;
	unsigned long bad = 0;

	fill(&in, 1 + id);
	for (unsigned long r = 0; r < rounds; r++) {
		memset(&out, 0, sizeof(out));
		around_syscall(&in, &out, SYS_sched_yield, 0);
		if (differ("after sched_yield", &in, &out) && ++bad >= 8)
			break;
	}
	return bad;
}

int main(int argc, char **argv)
{
	struct options o = { .procs = 4, .rounds = 20000, .tag = "" };
	const struct arg_spec specs[] = {
		{ "--procs", ARG_UINT, &o.procs, 0 },
		{ "--rounds", ARG_ULONG, &o.rounds, ULONG_MAX },
		{ "--tag", ARG_STRING, &o.tag, 0 },
	};
	pid_t pids[MAX_PROCS];
	unsigned long procs_changed = 0;
	int rc, forked;

	rc = args_parse("fpkeep", USAGE, argc, argv, specs, ARRAY_LEN(specs));
	if (rc)
		return rc;
	if (!o.procs || o.procs > MAX_PROCS)
		return args_usage("fpkeep", USAGE, "--procs wants 1 to 64");

	forked = fork_keeps();
	if (forked == 3) {
		perror("fpkeep: fork");
		return 3;
	}
	for (unsigned int i = 0; i < o.procs; i++) {
		pids[i] = fork();
		if (pids[i] < 0) {
			perror("fpkeep: fork");
			return 3;
		}
		if (pids[i] == 0)
			_exit(yield_keeps(i, o.rounds) ? 1 : 0);
	}
	for (unsigned int i = 0; i < o.procs; i++) {
		int status;

		if (waitpid(pids[i], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status))
			procs_changed++;
	}
	printf("{\"prog\":\"fpkeep\",\"tag\":\"%s\",\"procs\":%u,\"rounds\":%lu,"
	       "\"fork_kept\":%s,\"procs_changed\":%lu}\n",
	       o.tag, o.procs, o.rounds, forked ? "false" : "true", procs_changed);
	return forked || procs_changed ? 1 : 0;
}
