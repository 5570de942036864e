#!/usr/bin/env bash
# check-wording.sh: the project speaks of the project, not of how it was
# made. Fails when a tracked file names a work session, a stop or an issue
# by its number, or speaks of "this" session: docs, READMEs, code comments,
# the kernel and QEMU patches, the lab, guest/ and vhost-user-balloon/.
# Such text means nothing to a reader of the repository; name the
# behaviour instead ("kprezerod charges its whole slice to the CPU budget").
#
# Usage: scripts/check-wording.sh    (from anywhere inside a git work tree)
# Prints FILE:LINE: TEXT for every hit; exits 1 if there is one, 0 if not.
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"

# The words session, stop and issue (any case, plural too) followed by a
# number, a "#" number or a hyphen and a number. "SSH session",
# "stop-and-copy" or "stop the guest" have no number after the word.
numbered='\b(sessions?|stops?|issues?)[ -]+#?[0-9]+'
this_session='\bthis session\b'
# "#12" as a reference: at the start of a line or after a blank, "(" or ",".
# "[#1]" in a kernel oops and colours such as "#1f77b4" do not match.
hash_ref='(^|[[:space:](,])#[0-9]+\b'
pattern="$numbered|$this_session|$hash_ref"

# Text that looks like a hit but is not one; removed from a hit's line
# before the line is tested again, so that a real hit next to it still
# counts. A hit must remain both in the line alone and in the line
# preceded by the last two words of the line before it, so that a
# reference wrapped after "virtio-spec" is still recognised.
#  - upstream trackers: "virtio-spec issue #244", "virtio-spec issues #244, #242"
#  - kernel build numbers in recorded boot logs: "#1 SMP", "#1 Sun Nov 22 ..."
allowed='virtio-spec[[:space:]]+issues?[[:space:]]+#[0-9]+(,[[:space:]]*#[0-9]+)*'
allowed+='|#[0-9]+ (SMP|PREEMPT|Mon|Tue|Wed|Thu|Fri|Sat|Sun)\b'

candidates=$(git ls-files -z |
	xargs -0 -r grep -HnIisE -e "$pattern" -- || true)

hits=0
while IFS= read -r hit; do
	[ -n "$hit" ] || continue
	file=${hit%%:*}
	rest=${hit#*:}
	line=${rest%%:*}
	text=${rest#*:}
	before=""
	if [ "$line" -gt 1 ]; then
		before=$(sed -n "$((line - 1))p" -- "$file" | awk '{ print (NF > 1 ? $(NF - 1) " " : "") (NF > 0 ? $NF : "") }')
	fi
	alone=$(printf '%s\n' "$text" | sed -E "s/$allowed//gI")
	joined=$(printf '%s %s\n' "$before" "$text" | sed -E "s/$allowed//gI")
	if printf '%s\n' "$alone" | grep -qiE -e "$pattern" &&
		printf '%s\n' "$joined" | grep -qiE -e "$pattern"; then
		printf '%s:%s: %s\n' "$file" "$line" "$text"
		hits=$((hits + 1))
	fi
done <<<"$candidates"

if [ "$hits" -gt 0 ]; then
	echo "check-wording: $hits line(s) name a session, stop or issue number;" \
		"say what the code does instead" >&2
	exit 1
fi
exit 0
