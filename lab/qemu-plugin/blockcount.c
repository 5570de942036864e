// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * QEMU TCG plugin: how often every translation block ran.
 *
 *   -plugin libblockcount.so,out=FILE
 *
 * At exit, FILE gets one line per block that ran: its start address (hex),
 * its instruction count and how many times it ran. A block's instructions
 * times its runs is what it executed; `freepage trace --loop fault` charges
 * that to the kernel function the block starts in.
 *
 * Counting starts when the guest first runs user space, an address below
 * USER_END after the kernel ran at its own addresses (the boot code runs
 * below USER_END too, before it jumps there): the kernel's boot, whose
 * clock calibration loops run as long as the host lets them, stays out.
 */
#include <glib.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>

#include <qemu-plugin.h>

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

/* x86_64: user space ends where the canonical hole starts */
#define USER_END 0x0000800000000000ULL

struct block {
	uint64_t pc;
	uint64_t insns;
	struct qemu_plugin_scoreboard *runs;
	/* runs before counting started */
	uint64_t before;
};

/* blocks by (start address, length): a block translated again is the same */
static GHashTable *blocks;
static GMutex lock;
static char *out_path;
static bool kernel_ran, started;

static guint block_hash(gconstpointer p)
{
	const struct block *b = p;

	return g_int64_hash(&b->pc) ^ (guint)b->insns;
}

static gboolean block_equal(gconstpointer a, gconstpointer b)
{
	const struct block *x = a, *y = b;

	return x->pc == y->pc && x->insns == y->insns;
}

static void write_counts(qemu_plugin_id_t id, void *unused)
{
	GHashTableIter it;
	gpointer key;
	FILE *f;

	f = fopen(out_path, "w");
	if (!f) {
		qemu_plugin_outs("blockcount: cannot write the counts\n");
		return;
	}
	g_hash_table_iter_init(&it, blocks);
	while (g_hash_table_iter_next(&it, &key, NULL)) {
		struct block *b = key;
		uint64_t runs = qemu_plugin_u64_sum(qemu_plugin_scoreboard_u64(b->runs));

		if (runs > b->before)
			fprintf(f, "%" PRIx64 " %" PRIu64 " %" PRIu64 "\n", b->pc, b->insns,
				runs - b->before);
	}
	fclose(f);
}

/* The first user-space block runs: what ran so far is the boot's */
static void start_counting(unsigned int vcpu, void *unused)
{
	GHashTableIter it;
	gpointer key;

	g_mutex_lock(&lock);
	if (!started) {
		g_hash_table_iter_init(&it, blocks);
		while (g_hash_table_iter_next(&it, &key, NULL)) {
			struct block *b = key;

			b->before = qemu_plugin_u64_sum(qemu_plugin_scoreboard_u64(b->runs));
		}
		started = true;
	}
	g_mutex_unlock(&lock);
}

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
	struct block probe = {
		.pc = qemu_plugin_tb_vaddr(tb),
		.insns = qemu_plugin_tb_n_insns(tb),
	};
	struct block *b;

	g_mutex_lock(&lock);
	b = g_hash_table_lookup(blocks, &probe);
	if (!b) {
		b = g_new(struct block, 1);
		*b = probe;
		b->runs = qemu_plugin_scoreboard_new(sizeof(uint64_t));
		g_hash_table_add(blocks, b);
	}
	if (probe.pc >= USER_END)
		kernel_ran = true;
	else if (!started && kernel_ran)
		qemu_plugin_register_vcpu_tb_exec_cb(tb, start_counting,
						     QEMU_PLUGIN_CB_NO_REGS, NULL);
	g_mutex_unlock(&lock);
	qemu_plugin_register_vcpu_tb_exec_inline_per_vcpu(
		tb, QEMU_PLUGIN_INLINE_ADD_U64, qemu_plugin_scoreboard_u64(b->runs), 1);
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
					   int argc, char **argv)
{
	for (int i = 0; i < argc; i++) {
		if (g_str_has_prefix(argv[i], "out=")) {
			out_path = g_strdup(argv[i] + 4);
		} else {
			fprintf(stderr, "blockcount: unknown option %s (out=FILE)\n", argv[i]);
			return -1;
		}
	}
	if (!out_path) {
		fprintf(stderr, "blockcount: out=FILE is required\n");
		return -1;
	}
	blocks = g_hash_table_new(block_hash, block_equal);
	qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
	qemu_plugin_register_atexit_cb(id, write_counts, NULL);
	return 0;
}
