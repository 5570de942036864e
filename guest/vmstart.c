// SPDX-License-Identifier: GPL-2.0
/*
 * vmstart: how long a VMM takes from its start to the first instruction
 * of its VM, and what that cost it. Runs the command after "--" (a VMM
 * whose VM writes a byte to its serial port as its first act, the serial
 * port being the VMM's stdout) with its stdout on a pipe, and waits for
 * the first byte there. Then, with the VMM still alive, it reads what
 * the VMM spent from /proc: CPU time of its threads (the scheduler's
 * runtime, /proc/<pid>/task/<tid>/schedstat, ns; and utime + stime in
 * clock ticks, which count threads that ended too), its minor faults,
 * its resident memory, and the machine's AnonHugePages. Then it kills
 * the VMM (SIGKILL) and reaps it; the VMM also dies with vmstart
 * (PR_SET_PDEATHSIG), so none is left behind. One JSON line on stdout.
 *
 *   vmstart [--timeout-s S] [--tag TEXT] [--mark LINE] -- COMMAND [ARG...]
 *
 * S (default 600) bounds the wait for the byte. LINE is printed the
 * moment the byte comes, before anything is read, for a console whose
 * reader timestamps lines. "exit_status" is the
 * VMM's (128 + signal: 137 where vmstart killed it after the byte).
 *
 * Exit codes: 0 the byte came, 1 the VMM exited or timed out first (the
 * line says which), 2 usage error, 3 pipe or fork failed.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "args.h"
#include "clock.h"

#define USAGE "vmstart [--timeout-s S] [--tag TEXT] [--mark LINE] -- COMMAND [ARG...]"

struct spent {
	long long cpu_ns;	/* schedstat of the live threads; -1 without it */
	long long ticks;	/* utime + stime, every thread so far */
	long long minflt;
	long long rss_kib;
	long long anon_huge_kib;	/* the machine's, /proc/meminfo */
	int threads;
};

/* The first number after "@key" at the start of a line of @path, or -1 */
static long long field_of(const char *path, const char *key)
{
	char line[256];
	long long v = -1;
	size_t n = strlen(key);
	FILE *f = fopen(path, "r");

	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, key, n)) {
			v = strtoll(line + n, NULL, 10);
			break;
		}
	fclose(f);
	return v;
}

/* utime + stime and minflt of @pid from /proc/<pid>/stat */
static void read_stat(pid_t pid, struct spent *s)
{
	char path[64], buf[1024], *p;
	unsigned long long minflt, utime, stime;
	ssize_t n;
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/stat", pid);
	fd = open(path, O_RDONLY);
	if (fd < 0)
		return;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return;
	buf[n] = 0;
	/* after the command name in parentheses: state is field 3 */
	p = strrchr(buf, ')');
	if (p && sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %llu %*u %*u %*u %llu %llu",
			&minflt, &utime, &stime) == 3) {
		s->minflt = (long long)minflt;
		s->ticks = (long long)(utime + stime);
	}
}

/* The runtime of every live thread of @pid (schedstat), and their number */
static void read_threads(pid_t pid, struct spent *s)
{
	char path[300];
	struct dirent *d;
	DIR *dir;

	snprintf(path, sizeof(path), "/proc/%d/task", pid);
	dir = opendir(path);
	if (!dir)
		return;
	s->cpu_ns = 0;
	while ((d = readdir(dir))) {
		unsigned long long ns;
		FILE *f;

		if (d->d_name[0] == '.')
			continue;
		s->threads++;
		snprintf(path, sizeof(path), "/proc/%d/task/%s/schedstat", pid, d->d_name);
		f = fopen(path, "r");
		if (!f || fscanf(f, "%llu", &ns) != 1)
			s->cpu_ns = -1;
		else if (s->cpu_ns >= 0)
			s->cpu_ns += (long long)ns;
		if (f)
			fclose(f);
	}
	closedir(dir);
}

/* The VMM's resident memory and the machine's THP-backed anonymous memory */
static void read_memory(pid_t pid, struct spent *s)
{
	char path[64];

	snprintf(path, sizeof(path), "/proc/%d/status", pid);
	s->rss_kib = field_of(path, "VmRSS:");
	s->anon_huge_kib = field_of("/proc/meminfo", "AnonHugePages:");
}

static void json_string(const char *s)
{
	putchar('"');
	for (; *s; s++)
		if (*s == '"' || *s == '\\')
			printf("\\%c", *s);
		else if ((unsigned char)*s < 0x20)
			printf("\\u%04x", *s);
		else
			putchar(*s);
	putchar('"');
}

int main(int argc, char **argv)
{
	unsigned long timeout_s = 600;
	const char *tag = "", *mark = NULL;
	const struct arg_spec specs[] = {
		{ "--timeout-s", ARG_ULONG, &timeout_s, 86400UL },
		{ "--tag", ARG_STRING, &tag, 0 },
		{ "--mark", ARG_STRING, &mark, 0 },
	};
	struct spent s = { .cpu_ns = -1, .ticks = -1, .minflt = -1, .rss_kib = -1,
			   .anon_huge_kib = -1 };
	const char *outcome = "first_byte";
	int dash, rc, fds[2], status = 0;
	unsigned char byte = 0;
	uint64_t t0, t1 = 0;
	pid_t pid;

	for (dash = 1; dash < argc && strcmp(argv[dash], "--"); dash++)
		;
	rc = args_parse("vmstart", USAGE, dash, argv, specs, ARRAY_LEN(specs));
	if (rc)
		return rc;
	if (dash + 1 >= argc)
		return args_usage("vmstart", USAGE, "no command after --");
	if (!timeout_s)
		return args_usage("vmstart", USAGE, "--timeout-s must be positive");

	if (pipe2(fds, O_CLOEXEC)) {
		perror("vmstart: pipe");
		return 3;
	}
	fflush(stdout);
	t0 = now_ns();
	pid = fork();
	if (pid < 0) {
		perror("vmstart: fork");
		return 3;
	}
	if (!pid) {
		int null = open("/dev/null", O_RDONLY);

		/* the VMM goes with vmstart, whatever ends it */
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() == 1)
			_exit(127);
		if (null < 0 || dup2(null, 0) < 0 || dup2(fds[1], 1) < 0)
			_exit(127);
		execvp(argv[dash + 1], argv + dash + 1);
		fprintf(stderr, "vmstart: %s: %s\n", argv[dash + 1], strerror(errno));
		_exit(127);
	}
	close(fds[1]);

	for (;;) {
		struct pollfd pfd = { .fd = fds[0], .events = POLLIN };
		int64_t left = (int64_t)(t0 + timeout_s * 1000000000ULL - now_ns());
		ssize_t n;

		if (left <= 0) {
			outcome = "timeout";
			break;
		}
		rc = poll(&pfd, 1, (int)(left / 1000000 + 1));
		if (rc < 0 && errno == EINTR)
			continue;
		if (rc <= 0)
			continue;
		n = read(fds[0], &byte, 1);
		if (n == 1) {
			t1 = now_ns();
			if (mark) {
				puts(mark);
				fflush(stdout);
			}
			read_stat(pid, &s);
			read_threads(pid, &s);
			read_memory(pid, &s);
			break;
		}
		if (n == 0 || errno != EINTR) {
			outcome = "exited";
			break;
		}
	}
	kill(pid, SIGKILL);
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	close(fds[0]);

	printf("{\"prog\":\"vmstart\",\"tag\":");
	json_string(tag);
	printf(",\"outcome\":\"%s\",\"first_byte_ns\":%llu,\"byte\":%u,\"cpu_ns\":%lld,"
	       "\"cpu_ticks\":%lld,\"minflt\":%lld,\"rss_kib\":%lld,\"anon_huge_kib\":%lld,"
	       "\"threads\":%d,\"exit_status\":%d}\n",
	       outcome, t1 ? (unsigned long long)(t1 - t0) : 0ULL, byte, s.cpu_ns, s.ticks,
	       s.minflt, s.rss_kib, s.anon_huge_kib, s.threads,
	       WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
	return t1 ? 0 : 1;
}
