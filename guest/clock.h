/* SPDX-License-Identifier: GPL-2.0 */
/* Time and fault counts shared by the guest programs. */
#ifndef FREEPAGE_GUEST_CLOCK_H
#define FREEPAGE_GUEST_CLOCK_H

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

#endif
