#!/bin/sh
# Every numeric option of the guest programs refuses what is not a
# whole number in range, and every program refuses an unknown option or
# a missing value: exit 2 and a message naming the option. Runs
# the programs on the build host (they are static x86_64 binaries);
# none of these calls gets as far as touching memory (a program that
# took a bad value and started anyway is stopped after 5 s).
set -u
out=${1:?usage: check-args.sh BUILD_DIR}
fail=0

expect_refused() {
	prog=$1; opt=$2; shift 2
	msg=$(timeout 5 "$out/$prog" "$@" 2>&1 >/dev/null)
	rc=$?
	case "$rc:$msg" in
	2:*"$opt"*) ;;
	*) echo "check-args: $prog $*: exit $rc, '$msg' (want exit 2 naming $opt)"; fail=1 ;;
	esac
}

for bad in abc 12x -1 "" 0x 99999999999999999999999; do
	expect_refused populate --mib --mib "$bad"
	expect_refused churn --mib --mib "$bad"
	expect_refused dirty --mib --mib "$bad"
	expect_refused pagefault --mib --mib "$bad" --seconds 1
	expect_refused cachewalk --kib --kib "$bad"
	expect_refused hugefit --mib --mib "$bad" --ms 1
	expect_refused hugefit --ms --mib 2 --ms "$bad"
	expect_refused hugecow --pages --pages "$bad"
	expect_refused fragment --mib --mib "$bad"
	expect_refused fragment --seconds --mib 1 --seconds "$bad"
	expect_refused fpkeep --rounds --rounds "$bad"
	expect_refused fpkeep --procs --procs "$bad"
	expect_refused reuse --mib --mib "$bad"
	expect_refused vmstart --timeout-s --timeout-s "$bad" -- true
done
expect_refused populate --fill --mib 1 --fill 0x100
expect_refused populate --repeat --mib 1 --repeat 4294967296
expect_refused churn --iterations --mib 1 --iterations 1e3
expect_refused cachewalk --seconds --kib 64 --seconds nan
expect_refused dirty --pace-ms --mib 1 --pace-ms 5ms
expect_refused pagefault --seconds --mib 1 --seconds 2.5
expect_refused fragment --sleep-ms --mib 1 --sleep-ms 1e2
expect_refused reuse --seconds --mib 1 --seconds nan
# an option no program has, and an option without its value
for prog in populate churn dirty pagefault cachewalk hugefit hugecow fragment reuse fpkeep vmstart; do
	expect_refused $prog --bogus --bogus 1
done
expect_refused populate --mib --mib
expect_refused churn --tag --tag
expect_refused cachewalk --seconds --kib 64 --seconds
expect_refused vmstart --tag --tag

[ $fail = 0 ] && echo "check-args: every bad number refused"
exit $fail
