/* SPDX-License-Identifier: GPL-2.0 */
/* Time, sleeps and fault counts shared by the guest programs. */
#ifndef FREEPAGE_GUEST_CLOCK_H
#define FREEPAGE_GUEST_CLOCK_H

#include <errno.h>
#include <stdint.h>
#include <sys/resource.h>
#include <time.h>

/* Monotonic time in ns */
static inline uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* Minor page faults of this process so far */
static inline long minor_faults(void)
{
	struct rusage ru;

	getrusage(RUSAGE_SELF, &ru);
	return ru.ru_minflt;
}

/* Sleep @ms milliseconds, through signals */
static inline void sleep_ms(unsigned int ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

#endif
