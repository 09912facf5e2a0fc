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

#endif /* SMARTIO_STUB_H */
