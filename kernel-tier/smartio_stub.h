/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The interface between the kernel tier's SmartIO stand-in (smartio_stub.c, module "smartio")
 * and the module that gives its devices an mdev parent (the kernel's mtty sample, renamed and
 * patched by smartio_mdev.patch, module "smartio_mdev").
 *
 * The stub owns class "smartio" and one device per fabric device, smartio-<fdid>. When vmlend
 * writes an fdid to class/smartio/borrow, the stub asks the provider to register an mdev parent
 * on that device (so class/mdev_bus/smartio-<fdid> is the device's own directory, and the mdev
 * core names its types "smartio-<group>" after the device's class); unborrow, an unreachable
 * lender or the provider leaving unregister it again.
 */
#ifndef SMARTIO_STUB_H
#define SMARTIO_STUB_H

#include <linux/device.h>

struct smartio_mdev_provider {
	/* Register an mdev parent on @dev; a handle for detach, or an ERR_PTR. */
	void *(*attach)(struct device *dev);
	/* Unregister it (the mdev core removes its children first). */
	void (*detach)(void *parent);
};

int smartio_register_mdev_provider(const struct smartio_mdev_provider *provider);
/*
 * For a write to a child's data-path files (vmlend's contract, section 8) under the mdev
 * parent on @dev: 0, -ESTALE for a token older than the device's (or spent), -ENODEV for a
 * device leaving the fabric; *dma_bits is the device's DMA address width.
 */
int smartio_check_token(struct device *dev, u64 token, u32 *dma_bits);
void smartio_unregister_mdev_provider(const struct smartio_mdev_provider *provider);

/*
 * Queue-level NVMe shares (vmlend's contract, section 7): whether the device whose mdev parent
 * is on @dev is shared (its parent then offers smartio-nvme_share), and the shares its manager
 * runs, one per share child, set and cleared by the child's nvme_share (smartio_stub.c says
 * the errnos).
 */
struct smartio_share_values {
	u64 epoch;
	u32 first_qid;
	u32 queue_pairs;
	u32 vector_base;
	u32 vectors;
	u64 lba;
	u64 blocks;
	u32 asid;
	bool has_cmb;
	u64 cmb_offset;
	u64 cmb_bytes;
};

bool smartio_shareable(struct device *dev);
int smartio_share_set(struct device *dev, const char *uuid, const struct smartio_share_values *v);
int smartio_share_clear(struct device *dev, const char *uuid, u64 epoch, bool force);

/*
 * Peer-to-peer (vmlend's contract, section 8): what a child's p2p write needs to know of a
 * target BAR, from the stub's devices.
 */
enum smartio_p2p_case {
	SMARTIO_P2P_SAME_LENDER,	/* source and target lent by one host */
	SMARTIO_P2P_BORROWER_LOCAL,	/* the target is installed in this host */
	SMARTIO_P2P_OTHER_LENDER,	/* the target is lent by a third host */
};

struct smartio_p2p_target {
	u64 size;		/* the BAR's size in the target's 'bars' */
	bool io;		/* an I/O BAR */
	bool mem32;		/* a 32-bit memory BAR */
	enum smartio_p2p_case p2p_case;
	u32 adapter;		/* the source's lender adapter */
	bool borrowed;		/* source and target borrowed by this host now */
};

/* The fdid of the device whose mdev parent is on @dev. */
u32 smartio_fdid(struct device *dev);
/*
 * BAR @bar of device @fdid, seen from the device whose mdev parent is on @dev: 0; -ENODEV
 * without that device, -EINVAL without that BAR, -EAGAIN while the fabric is changing.
 */
int smartio_p2p_target(struct device *dev, u32 fdid, u32 bar, struct smartio_p2p_target *out);

#endif /* SMARTIO_STUB_H */
