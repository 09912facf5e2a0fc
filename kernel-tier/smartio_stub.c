// SPDX-License-Identifier: GPL-2.0
/*
 * smartio: a stand-in for the SmartIO driver in vmlend's kernel tier.
 *
 * It serves the sysfs contract of vmlend's docs/smartio-contract.md, sections 1 to 4, and
 * nothing of the hardware behind it:
 *
 *   class/smartio/node_id                 r   this host's node id (module parameter node_id)
 *   class/smartio/{lend,unlend}           w   an fdid: EINVAL, ENODEV, EREMOTE, EBUSY
 *   class/smartio/{borrow,unborrow}       w   an fdid: register / unregister its mdev parent
 *   class/smartio/take_back               w   "FDID TOKEN": ESTALE for an older token; the
 *                                                token is spent (a later write of it: ESTALE)
 *   class/smartio/smartio-<fdid>/         one device per fabric device, with fdid,
 *       lender_node_id, lender_adapter, lender_bdf, vendor, device, class, dma_bits, physfn,
 *       bars, availability, borrower_node_id (r) and token (rw; ESTALE for an older one)
 *   class/smartio/adapter<index>/         one per NTB adapter of this host (section 1): index,
 *       model, window_size, segments, lut_entries, link, peer, switch_port (r)
 *
 * A device's mdev parent comes from a provider module (smartio_stub.h: the kernel's mtty
 * sample, renamed), registered on the device's own directory on borrow. The provider serves
 * section 8's per-child files (smartio/dma_windows, smartio/dma_state) and checks their
 * token with smartio_check_token(). "change" uevents with
 * SMARTIO_AVAILABILITY=<value> go out when availability or borrower_node_id changes; the
 * device's own add/remove uevents when it joins or leaves the fabric.
 *
 * What happens elsewhere in the fabric is played through debugfs, outside the contract:
 * smartio/ctl takes one command per write:
 *
 *   add FDID LENDER ADAPTER BDF VENDOR DEVICE CLASS DMA_BITS PHYSFN|- AVAILABILITY BARS|-
 *       a device joins the fabric (Dolphin's "add <BDF>" on its lender); BARS is
 *       INDEX:SIZE:KIND[:prefetch] separated by commas
 *   remove FDID                 it leaves (its parent is unregistered first)
 *   availability FDID VALUE     available, unlent or unreachable (an unreachable device loses
 *                               its parent; it comes back with the device if vmlend wanted it)
 *   borrower FDID NODE          the hardware borrow (a guest enabled the device), -1 for none
 *   adapter INDEX MODEL WINDOW SEGMENTS LUT_ENTRIES LINK PEER|- PORT|-
 *                               an NTB adapter of this host; LINK is up or down, PEER the
 *                               adapter at a back-to-back cable's other end as NODE:INDEX,
 *                               PORT a cluster switch's port
 *   reset                       every device and adapter leaves
 */
#include <linux/debugfs.h>
#include <linux/device.h>
#include <linux/err.h>
#include <linux/kernel.h>
#include <linux/kobject.h>
#include <linux/list.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/slab.h>
#include <linux/version.h>
#include <linux/string.h>
#include <linux/sysfs.h>
#include <linux/uaccess.h>
#include <linux/uuid.h>
/*
 * The backports tier builds this file against 6.12 too (kernel-tier/backports/): class
 * callbacks take const pointers since 6.4, struct class lost .owner in 6.4, no_llseek went in
 * 6.12 (an fops without llseek is unseekable there).
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 4, 0)
#define SMARTIO_CLASS_CONST const
#else
#define SMARTIO_CLASS_CONST
#endif

#include "smartio_stub.h"

static unsigned int node_id = 12;
module_param(node_id, uint, 0444);
MODULE_PARM_DESC(node_id, "this host's fabric node id (1..65535)");

enum smartio_availability { SMARTIO_AVAILABLE, SMARTIO_UNLENT, SMARTIO_UNREACHABLE };

static const char * const availability_names[] = {
	[SMARTIO_AVAILABLE] = "available",
	[SMARTIO_UNLENT] = "unlent",
	[SMARTIO_UNREACHABLE] = "unreachable",
};

#define SMARTIO_BDF_LEN 16
#define SMARTIO_BARS_LEN 256
#define SMARTIO_CTL_MAX 512

struct smartio_dev {
	struct list_head node;
	struct device *dev;
	/* fixed when the device joins the fabric */
	u32 fdid;
	u32 lender_node_id;
	u32 lender_adapter;
	char lender_bdf[SMARTIO_BDF_LEN];
	u32 vendor;
	u32 device;
	u32 class_code;
	u32 dma_bits;
	bool has_physfn;
	u32 physfn;
	char bars[SMARTIO_BARS_LEN];
	/* changed under smartio_lock, read by the show functions without it */
	enum smartio_availability availability;
	int borrower;
	u64 token;
	/* under smartio_lock: the token the device was last taken back for */
	u64 retired;
	bool wants_parent;	/* borrowed on this host, until unborrow */
	void *parent;		/* the provider's handle while the mdev parent is registered */
	bool gone;		/* left the fabric; its device is about to be unregistered */
	/* section 7: set by the ctl's "share" before the borrow (the parent's types follow) */
	bool shareable;
	u32 share_queue_pairs;
	u32 share_vectors;
	struct list_head shares;	/* struct smartio_share, under smartio_share_lock */
};

/* One share the drive's manager runs: what a share child's nvme_share set (section 7). */
struct smartio_share {
	struct list_head node;
	char uuid[UUID_STRING_LEN + 1];
	struct smartio_share_values v;
};

#define SMARTIO_MODEL_LEN 33

/* One NTB adapter of this host: fixed when added, removed by reset. */
struct smartio_adapter {
	struct list_head node;
	struct device *dev;
	u32 index;
	char model[SMARTIO_MODEL_LEN];
	u64 window_size;
	u32 segments;
	u32 lut_entries;
	bool link_up;
	bool has_peer;
	u32 peer_node;
	u32 peer_index;
	bool has_port;
	u32 port;
};

static DEFINE_MUTEX(smartio_lock);
/*
 * The shares of every device (section 7). Not smartio_lock: a share child's store and its
 * removal run while a detach holding smartio_lock waits for the children to go.
 */
static DEFINE_MUTEX(smartio_share_lock);
static LIST_HEAD(smartio_devs);
static LIST_HEAD(smartio_adapters);
static const struct smartio_mdev_provider *smartio_provider;
static struct dentry *smartio_debugfs;

static struct smartio_dev *smartio_find(u32 fdid)
{
	struct smartio_dev *sdev;

	list_for_each_entry(sdev, &smartio_devs, node)
		if (sdev->fdid == fdid)
			return sdev;
	return NULL;
}

/* Split @s in place into at most @max blank-separated words; -EINVAL for more. */
static int smartio_split(char *s, char **words, int max)
{
	char *word;
	int n = 0;

	while ((word = strsep(&s, " \t\n")) != NULL) {
		if (!*word)
			continue;
		if (n == max)
			return -EINVAL;
		words[n++] = word;
	}
	return n;
}

/* --- the mdev parent ------------------------------------------------------------------ */

static int smartio_attach(struct smartio_dev *sdev)
{
	void *parent;

	if (sdev->parent)
		return 0;
	if (!smartio_provider)
		return -ENOSPC;	/* nothing can describe the device as an mdev parent */
	parent = smartio_provider->attach(sdev->dev);
	if (IS_ERR(parent))
		return PTR_ERR(parent);
	sdev->parent = parent;
	return 0;
}

static void smartio_detach(struct smartio_dev *sdev)
{
	if (!sdev->parent)
		return;
	smartio_provider->detach(sdev->parent);
	sdev->parent = NULL;
}

static int smartio_count_mdev(struct device *child, void *data)
{
	if (child->bus && !strcmp(child->bus->name, "mdev"))
		++*(int *)data;
	return 0;
}

static bool smartio_has_children(struct smartio_dev *sdev)
{
	int n = 0;

	device_for_each_child(sdev->dev, &n, smartio_count_mdev);
	return n > 0;
}

/* --- state changes, with the contract's uevent ------------------------------------------ */

static void smartio_set(struct smartio_dev *sdev, enum smartio_availability availability,
			int borrower)
{
	char env[40];
	char *envp[] = { env, NULL };

	if (availability != SMARTIO_AVAILABLE)
		borrower = -1;	/* nothing stays borrowed through a lender that is not there */
	if (sdev->availability == availability && sdev->borrower == borrower)
		return;
	WRITE_ONCE(sdev->availability, availability);
	WRITE_ONCE(sdev->borrower, borrower);
	snprintf(env, sizeof(env), "SMARTIO_AVAILABILITY=%s", availability_names[availability]);
	kobject_uevent_env(&sdev->dev->kobj, KOBJ_CHANGE, envp);
}

static void smartio_set_availability(struct smartio_dev *sdev,
				     enum smartio_availability availability)
{
	int ret;

	smartio_set(sdev, availability, sdev->borrower);
	if (availability == SMARTIO_UNREACHABLE) {
		smartio_detach(sdev);	/* remembered: wants_parent stays */
	} else if (availability == SMARTIO_AVAILABLE && sdev->wants_parent) {
		ret = smartio_attach(sdev);
		if (ret)
			dev_warn(sdev->dev, "cannot register the mdev parent again: %d\n", ret);
	}
}

/* --- class/smartio/smartio-<fdid>/ ------------------------------------------------------- */

static struct smartio_dev *to_smartio(struct device *dev)
{
	return dev_get_drvdata(dev);
}

#define SMARTIO_SHOW(_name, _fmt, _value)						\
static ssize_t smartio_##_name##_show(struct device *dev,				\
				      struct device_attribute *attr, char *buf)	\
{											\
	struct smartio_dev *sdev = to_smartio(dev);					\
											\
	return sysfs_emit(buf, _fmt "\n", _value);					\
}											\
static struct device_attribute dev_attr_##_name =					\
	__ATTR(_name, 0444, smartio_##_name##_show, NULL)

SMARTIO_SHOW(fdid, "%#x", sdev->fdid);
SMARTIO_SHOW(lender_node_id, "%u", sdev->lender_node_id);
SMARTIO_SHOW(lender_adapter, "%u", sdev->lender_adapter);
SMARTIO_SHOW(lender_bdf, "%s", sdev->lender_bdf);
SMARTIO_SHOW(vendor, "%#06x", sdev->vendor);
SMARTIO_SHOW(device, "%#06x", sdev->device);
SMARTIO_SHOW(class, "%#08x", sdev->class_code);
SMARTIO_SHOW(dma_bits, "%u", sdev->dma_bits);
SMARTIO_SHOW(availability, "%s", availability_names[READ_ONCE(sdev->availability)]);
SMARTIO_SHOW(borrower_node_id, "%d", READ_ONCE(sdev->borrower));

static ssize_t smartio_physfn_show(struct device *dev, struct device_attribute *attr,
				   char *buf)
{
	struct smartio_dev *sdev = to_smartio(dev);

	if (!sdev->has_physfn)
		return sysfs_emit(buf, "\n");
	return sysfs_emit(buf, "%#x\n", sdev->physfn);
}

static struct device_attribute dev_attr_physfn = __ATTR(physfn, 0444, smartio_physfn_show, NULL);

/* One line per BAR, each with its newline; nothing for a device without BARs. */
static ssize_t smartio_bars_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%s", to_smartio(dev)->bars);
}

static struct device_attribute dev_attr_bars = __ATTR(bars, 0444, smartio_bars_show, NULL);

static ssize_t smartio_token_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%llu\n", READ_ONCE(to_smartio(dev)->token));
}

/*
 * The fencing token of the hold the next step is made for: the largest is kept. A token the
 * device was taken back for is spent: its hold has ended, although no newer one came yet.
 */
static ssize_t smartio_token_store(struct device *dev, struct device_attribute *attr,
				   const char *buf, size_t count)
{
	struct smartio_dev *sdev = to_smartio(dev);
	u64 token;
	int ret;

	ret = kstrtou64(buf, 10, &token);
	if (ret)
		return -EINVAL;
	mutex_lock(&smartio_lock);
	if (sdev->gone)
		ret = -ENODEV;
	else if (token < sdev->token || token <= sdev->retired)
		ret = -ESTALE;
	else
		WRITE_ONCE(sdev->token, token);
	mutex_unlock(&smartio_lock);
	return ret ? ret : count;
}

static struct device_attribute dev_attr_token =
	__ATTR(token, 0644, smartio_token_show, smartio_token_store);

static ssize_t smartio_spent_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	struct smartio_dev *sdev = to_smartio(dev);
	u64 retired;

	mutex_lock(&smartio_lock);
	retired = sdev->retired;
	mutex_unlock(&smartio_lock);
	return sysfs_emit(buf, "%llu\n", retired);
}

/*
 * A hold ended normally (vmlend's release): its token is spent, served yet or not, so a step
 * made for it that is still in flight elsewhere is refused when it comes. Spending an older
 * token than one already spent changes nothing; it is never an error.
 */
static ssize_t smartio_spent_store(struct device *dev, struct device_attribute *attr,
				   const char *buf, size_t count)
{
	struct smartio_dev *sdev = to_smartio(dev);
	u64 token;
	int ret;

	ret = kstrtou64(buf, 10, &token);
	if (ret)
		return -EINVAL;
	mutex_lock(&smartio_lock);
	if (sdev->gone)
		ret = -ENODEV;
	else if (token > sdev->retired)
		sdev->retired = token;
	mutex_unlock(&smartio_lock);
	return ret ? ret : count;
}

static struct device_attribute dev_attr_spent =
	__ATTR(spent, 0644, smartio_spent_show, smartio_spent_store);

/*
 * Section 7: whether the manager can run this drive, and the shares it runs. The stand-in
 * runs no controller: it checks a share against the queue pairs and vectors the ctl gave it
 * and against the drive's other shares, and lists what it accepted.
 */
static ssize_t smartio_nvme_share_show(struct device *dev, struct device_attribute *attr,
				       char *buf)
{
	struct smartio_dev *sdev = to_smartio(dev);

	if (!READ_ONCE(sdev->shareable))
		return sysfs_emit(buf, "unsupported the stand-in was not asked to share it\n");
	return sysfs_emit(buf, "supported %u %u 0\n", sdev->share_queue_pairs,
			  sdev->share_vectors);
}

static struct device_attribute dev_attr_nvme_share =
	__ATTR(nvme_share, 0444, smartio_nvme_share_show, NULL);

static ssize_t smartio_nvme_shares_show(struct device *dev, struct device_attribute *attr,
					char *buf)
{
	struct smartio_dev *sdev = to_smartio(dev);
	struct smartio_share *sh;
	int n = 0;

	mutex_lock(&smartio_share_lock);
	list_for_each_entry(sh, &sdev->shares, node)
		n += sysfs_emit_at(buf, n, "%s %llu %u %u %u %u 0x%llx 0x%llx %u\n", sh->uuid,
				   sh->v.epoch, sh->v.first_qid, sh->v.queue_pairs,
				   sh->v.vector_base, sh->v.vectors, sh->v.lba, sh->v.blocks,
				   sh->v.asid);
	mutex_unlock(&smartio_share_lock);
	return n;
}

static struct device_attribute dev_attr_nvme_shares =
	__ATTR(nvme_shares, 0444, smartio_nvme_shares_show, NULL);

static struct attribute *smartio_dev_attrs[] = {
	&dev_attr_fdid.attr,
	&dev_attr_lender_node_id.attr,
	&dev_attr_lender_adapter.attr,
	&dev_attr_lender_bdf.attr,
	&dev_attr_vendor.attr,
	&dev_attr_device.attr,
	&dev_attr_class.attr,
	&dev_attr_dma_bits.attr,
	&dev_attr_physfn.attr,
	&dev_attr_bars.attr,
	&dev_attr_availability.attr,
	&dev_attr_borrower_node_id.attr,
	&dev_attr_token.attr,
	&dev_attr_spent.attr,
	&dev_attr_nvme_share.attr,
	&dev_attr_nvme_shares.attr,
	NULL,
};
ATTRIBUTE_GROUPS(smartio_dev);

/* --- class/smartio/adapter<index>/ ------------------------------------------------------ */

#define ADAPTER_SHOW(_name, _fmt, _value)						\
static ssize_t adapter_##_name##_show(struct device *dev,				\
				      struct device_attribute *attr, char *buf)	\
{											\
	struct smartio_adapter *ad = dev_get_drvdata(dev);				\
											\
	return sysfs_emit(buf, _fmt "\n", _value);					\
}											\
static struct device_attribute dev_attr_adapter_##_name =				\
	__ATTR(_name, 0444, adapter_##_name##_show, NULL)

ADAPTER_SHOW(index, "%u", ad->index);
ADAPTER_SHOW(model, "%s", ad->model);
ADAPTER_SHOW(window_size, "%#llx", ad->window_size);
ADAPTER_SHOW(segments, "%u", ad->segments);
ADAPTER_SHOW(lut_entries, "%u", ad->lut_entries);
ADAPTER_SHOW(link, "%s", ad->link_up ? "up" : "down");

/* "<node id> <adapter index>" at a back-to-back cable's other end; an empty line otherwise. */
static ssize_t adapter_peer_show(struct device *dev, struct device_attribute *attr, char *buf)
{
	struct smartio_adapter *ad = dev_get_drvdata(dev);

	if (!ad->has_peer)
		return sysfs_emit(buf, "\n");
	return sysfs_emit(buf, "%u %u\n", ad->peer_node, ad->peer_index);
}

static struct device_attribute dev_attr_adapter_peer = __ATTR(peer, 0444, adapter_peer_show, NULL);

static ssize_t adapter_switch_port_show(struct device *dev, struct device_attribute *attr,
					char *buf)
{
	struct smartio_adapter *ad = dev_get_drvdata(dev);

	if (!ad->has_port)
		return sysfs_emit(buf, "\n");
	return sysfs_emit(buf, "%u\n", ad->port);
}

static struct device_attribute dev_attr_adapter_switch_port =
	__ATTR(switch_port, 0444, adapter_switch_port_show, NULL);

static struct attribute *smartio_adapter_attrs[] = {
	&dev_attr_adapter_index.attr,
	&dev_attr_adapter_model.attr,
	&dev_attr_adapter_window_size.attr,
	&dev_attr_adapter_segments.attr,
	&dev_attr_adapter_lut_entries.attr,
	&dev_attr_adapter_link.attr,
	&dev_attr_adapter_peer.attr,
	&dev_attr_adapter_switch_port.attr,
	NULL,
};
ATTRIBUTE_GROUPS(smartio_adapter);

/* --- class/smartio/ --------------------------------------------------------------------- */

static ssize_t node_id_show(SMARTIO_CLASS_CONST struct class *class,
			    SMARTIO_CLASS_CONST struct class_attribute *attr, char *buf)
{
	return sysfs_emit(buf, "%u\n", node_id);
}
static CLASS_ATTR_RO(node_id);

/*
 * The fdid commands: parse, find the device, act under the lock. @act returns 0 or an errno.
 */
static ssize_t smartio_command(const char *buf, size_t count,
			       int (*act)(struct smartio_dev *sdev))
{
	struct smartio_dev *sdev;
	u32 fdid;
	int ret;

	if (kstrtou32(buf, 0, &fdid))
		return -EINVAL;
	mutex_lock(&smartio_lock);
	sdev = smartio_find(fdid);
	ret = sdev ? act(sdev) : -ENODEV;
	mutex_unlock(&smartio_lock);
	return ret ? ret : count;
}

static int smartio_lend(struct smartio_dev *sdev)
{
	if (sdev->lender_node_id != node_id)
		return -EREMOTE;
	if (sdev->availability == SMARTIO_UNLENT)
		smartio_set_availability(sdev, SMARTIO_AVAILABLE);
	return 0;
}

static int smartio_unlend(struct smartio_dev *sdev)
{
	if (sdev->lender_node_id != node_id)
		return -EREMOTE;
	if (sdev->borrower >= 0)
		return -EBUSY;
	smartio_set_availability(sdev, SMARTIO_UNLENT);
	return 0;
}

static int smartio_borrow(struct smartio_dev *sdev)
{
	int ret;

	if (sdev->availability == SMARTIO_UNLENT)
		return -EPERM;
	if (sdev->availability == SMARTIO_UNREACHABLE)
		return -EHOSTUNREACH;
	ret = smartio_attach(sdev);
	if (!ret)
		sdev->wants_parent = true;
	return ret;
}

static int smartio_unborrow(struct smartio_dev *sdev)
{
	if (sdev->parent && smartio_has_children(sdev))
		return -EBUSY;
	smartio_detach(sdev);
	sdev->wants_parent = false;
	return 0;
}

#define SMARTIO_COMMAND(_name)								\
static ssize_t _name##_store(SMARTIO_CLASS_CONST struct class *class,		\
			     SMARTIO_CLASS_CONST struct class_attribute *attr,	\
			     const char *buf, size_t count)				\
{											\
	return smartio_command(buf, count, smartio_##_name);				\
}											\
static CLASS_ATTR_WO(_name)

SMARTIO_COMMAND(lend);
SMARTIO_COMMAND(unlend);
SMARTIO_COMMAND(borrow);
SMARTIO_COMMAND(unborrow);

/* "FDID TOKEN": end the device's hardware borrow, unless a newer hold has it. */
static ssize_t take_back_store(SMARTIO_CLASS_CONST struct class *class,
			       SMARTIO_CLASS_CONST struct class_attribute *attr,
			       const char *buf, size_t count)
{
	struct smartio_dev *sdev;
	char *copy, *words[3];
	u32 fdid;
	u64 token;
	int ret;

	copy = kstrndup(buf, count, GFP_KERNEL);
	if (!copy)
		return -ENOMEM;
	ret = smartio_split(copy, words, ARRAY_SIZE(words));
	if (ret != 2 || kstrtou32(words[0], 0, &fdid) || kstrtou64(words[1], 10, &token))
		ret = -EINVAL;
	else
		ret = 0;
	kfree(copy);
	if (ret)
		return ret;
	mutex_lock(&smartio_lock);
	sdev = smartio_find(fdid);
	if (!sdev) {
		ret = -ENODEV;
	} else if (token < sdev->token) {
		ret = -ESTALE;
	} else {
		if (token > sdev->retired)
			sdev->retired = token;
		WRITE_ONCE(sdev->token, token);
		smartio_set(sdev, sdev->availability, -1);
	}
	mutex_unlock(&smartio_lock);
	return ret ? ret : count;
}
static CLASS_ATTR_WO(take_back);

static struct attribute *smartio_class_attrs[] = {
	&class_attr_node_id.attr,
	&class_attr_lend.attr,
	&class_attr_unlend.attr,
	&class_attr_borrow.attr,
	&class_attr_unborrow.attr,
	&class_attr_take_back.attr,
	NULL,
};
ATTRIBUTE_GROUPS(smartio_class);

static struct class smartio_class = {
	.name = "smartio",
#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 4, 0)
	.owner = THIS_MODULE,
#endif
	.class_groups = smartio_class_groups,
};

/* --- the provider of mdev parents ------------------------------------------------------- */

int smartio_register_mdev_provider(const struct smartio_mdev_provider *provider)
{
	struct smartio_dev *sdev;
	int ret = 0;

	mutex_lock(&smartio_lock);
	if (smartio_provider) {
		ret = -EBUSY;
		goto out;
	}
	smartio_provider = provider;
	/* Parents borrowed before the provider came, as a lender that comes back. */
	list_for_each_entry(sdev, &smartio_devs, node)
		if (sdev->wants_parent && sdev->availability == SMARTIO_AVAILABLE &&
		    smartio_attach(sdev))
			dev_warn(sdev->dev, "cannot register its mdev parent\n");
out:
	mutex_unlock(&smartio_lock);
	return ret;
}
EXPORT_SYMBOL_GPL(smartio_register_mdev_provider);

/*
 * Without smartio_lock: the provider calls it from a child's store handler, and a detach
 * holding the lock waits for that handler to finish while it removes the child. The token
 * is written with WRITE_ONCE; a take-back racing the check is the driver's to order, not the
 * stand-in's.
 */
int smartio_check_token(struct device *dev, u64 token, u32 *dma_bits)
{
	struct smartio_dev *sdev = to_smartio(dev);

	*dma_bits = sdev->dma_bits;
	if (READ_ONCE(sdev->gone))
		return -ENODEV;
	if (token < READ_ONCE(sdev->token) || token <= READ_ONCE(sdev->retired))
		return -ESTALE;
	return 0;
}
EXPORT_SYMBOL_GPL(smartio_check_token);

/* --- queue-level NVMe shares (section 7), for the provider's share children ------------- */

bool smartio_shareable(struct device *dev)
{
	return READ_ONCE(to_smartio(dev)->shareable);
}
EXPORT_SYMBOL_GPL(smartio_shareable);

static bool smartio_overlap(u64 a, u64 alen, u64 b, u64 blen)
{
	return a < b + blen && b < a + alen;
}

static struct smartio_share *smartio_share_find(struct smartio_dev *sdev, const char *uuid)
{
	struct smartio_share *sh;

	list_for_each_entry(sh, &sdev->shares, node)
		if (!strcmp(sh->uuid, uuid))
			return sh;
	return NULL;
}

/* The allocation of two shares is the same (a newer epoch of it is a hot move). */
static bool smartio_same_share(const struct smartio_share_values *a,
			       const struct smartio_share_values *b)
{
	return a->first_qid == b->first_qid && a->queue_pairs == b->queue_pairs &&
	       a->vector_base == b->vector_base && a->vectors == b->vectors &&
	       a->lba == b->lba && a->blocks == b->blocks && a->asid == b->asid &&
	       a->has_cmb == b->has_cmb && a->cmb_offset == b->cmb_offset &&
	       a->cmb_bytes == b->cmb_bytes;
}

/*
 * Child @uuid's share of the device whose parent is on @dev: 0 (set, or the same again),
 * -ENODEV (left the fabric), -EOPNOTSUPP (not shareable), -ESTALE (an older epoch than the
 * one it is set under), -ERANGE (beyond the controller), -EBUSY (another allocation while
 * set), -EEXIST (overlaps another child's share), -ENOMEM.
 */
int smartio_share_set(struct device *dev, const char *uuid, const struct smartio_share_values *v)
{
	struct smartio_dev *sdev = to_smartio(dev);
	struct smartio_share *sh, *mine;
	int ret = 0;

	if (READ_ONCE(sdev->gone))
		return -ENODEV;
	if (!READ_ONCE(sdev->shareable))
		return -EOPNOTSUPP;
	mutex_lock(&smartio_share_lock);
	mine = smartio_share_find(sdev, uuid);
	if (mine && v->epoch < mine->v.epoch) {
		ret = -ESTALE;
		goto out;
	}
	if ((u64)v->first_qid + v->queue_pairs - 1 > sdev->share_queue_pairs ||
	    (u64)v->vector_base + v->vectors > sdev->share_vectors) {
		ret = -ERANGE;
		goto out;
	}
	if (mine && !smartio_same_share(&mine->v, v)) {
		ret = -EBUSY;
		goto out;
	}
	list_for_each_entry(sh, &sdev->shares, node) {
		if (sh == mine)
			continue;
		if (smartio_overlap(v->first_qid, v->queue_pairs, sh->v.first_qid,
				    sh->v.queue_pairs) ||
		    smartio_overlap(v->vector_base, v->vectors, sh->v.vector_base,
				    sh->v.vectors) ||
		    smartio_overlap(v->lba, v->blocks, sh->v.lba, sh->v.blocks) ||
		    v->asid == sh->v.asid ||
		    (v->has_cmb && sh->v.has_cmb &&
		     smartio_overlap(v->cmb_offset, v->cmb_bytes, sh->v.cmb_offset,
				     sh->v.cmb_bytes))) {
			ret = -EEXIST;
			goto out;
		}
	}
	if (!mine) {
		mine = kzalloc(sizeof(*mine), GFP_KERNEL);
		if (!mine) {
			ret = -ENOMEM;
			goto out;
		}
		strscpy(mine->uuid, uuid, sizeof(mine->uuid));
		list_add_tail(&mine->node, &sdev->shares);
	}
	mine->v = *v;
out:
	mutex_unlock(&smartio_share_lock);
	return ret;
}
EXPORT_SYMBOL_GPL(smartio_share_set);

/*
 * End child @uuid's share: 0 (ended, or none set), -ESTALE for an epoch older than the one
 * it is set under, unless @force (the child is going: the driver ends its share itself).
 */
int smartio_share_clear(struct device *dev, const char *uuid, u64 epoch, bool force)
{
	struct smartio_dev *sdev = to_smartio(dev);
	struct smartio_share *sh;
	int ret = 0;

	mutex_lock(&smartio_share_lock);
	sh = smartio_share_find(sdev, uuid);
	if (sh && !force && epoch < sh->v.epoch) {
		ret = -ESTALE;
	} else if (sh) {
		list_del(&sh->node);
		kfree(sh);
	}
	mutex_unlock(&smartio_share_lock);
	return ret;
}
EXPORT_SYMBOL_GPL(smartio_share_clear);

void smartio_unregister_mdev_provider(const struct smartio_mdev_provider *provider)
{
	struct smartio_dev *sdev;

	mutex_lock(&smartio_lock);
	if (smartio_provider == provider) {
		list_for_each_entry(sdev, &smartio_devs, node)
			smartio_detach(sdev);
		smartio_provider = NULL;
	}
	mutex_unlock(&smartio_lock);
}
EXPORT_SYMBOL_GPL(smartio_unregister_mdev_provider);

/*
 * --- peer-to-peer targets (section 8), for the provider's p2p files ----------------------
 * The provider also serves each child's guest_bars, p2p and p2p_state; a p2p line's target
 * BAR, the map's case and whether both devices are borrowed here come from these devices.
 */

u32 smartio_fdid(struct device *dev)
{
	return to_smartio(dev)->fdid;	/* fixed while the device is in the fabric */
}
EXPORT_SYMBOL_GPL(smartio_fdid);

/* BAR @bar in a device's 'bars' text: 0 with its size and kind, -EINVAL without it. */
static int smartio_find_bar(const char *bars, u32 bar, struct smartio_p2p_target *out)
{
	char kind[16];
	u64 size;
	u32 index;

	while (*bars) {
		if (sscanf(bars, "%u %llx %15s", &index, &size, kind) == 3 && index == bar) {
			out->size = size;
			out->io = !strcmp(kind, "io");
			out->mem32 = !strcmp(kind, "mem32");
			return 0;
		}
		bars = strchrnul(bars, '\n');
		if (*bars)
			bars++;
	}
	return -EINVAL;
}

/*
 * Never waits for smartio_lock: a parent being detached holds it while the mdev core removes
 * the children, which waits for this child's store to return.
 */
int smartio_p2p_target(struct device *dev, u32 fdid, u32 bar, struct smartio_p2p_target *out)
{
	struct smartio_dev *src = to_smartio(dev), *dst;
	int ret;

	if (!mutex_trylock(&smartio_lock))
		return -EAGAIN;
	dst = smartio_find(fdid);
	if (!dst || dst->gone) {
		ret = -ENODEV;
		goto out;
	}
	ret = smartio_find_bar(dst->bars, bar, out);
	if (ret)
		goto out;
	if (dst->lender_node_id == src->lender_node_id)
		out->p2p_case = SMARTIO_P2P_SAME_LENDER;
	else if (dst->lender_node_id == node_id)
		out->p2p_case = SMARTIO_P2P_BORROWER_LOCAL;
	else
		out->p2p_case = SMARTIO_P2P_OTHER_LENDER;
	out->adapter = src->lender_adapter;
	out->borrowed = src->borrower == (int)node_id && dst->borrower == (int)node_id;
out:
	mutex_unlock(&smartio_lock);
	return ret;
}
EXPORT_SYMBOL_GPL(smartio_p2p_target);

/* --- debugfs smartio/ctl: the rest of the fabric ---------------------------------------- */

static int smartio_parse_availability(const char *word, enum smartio_availability *out)
{
	int i = match_string(availability_names, ARRAY_SIZE(availability_names), word);

	if (i < 0)
		return -EINVAL;
	*out = i;
	return 0;
}

/* "INDEX:SIZE:KIND[:prefetch],..." as the contract's lines "INDEX SIZE KIND [prefetch]". */
static int smartio_parse_bars(char *spec, char *out, size_t len)
{
	char *bar, *index, *size, *kind, *prefetch;
	size_t used = 0;
	u64 bytes;
	u32 i;

	if (!strcmp(spec, "-"))
		return 0;
	while ((bar = strsep(&spec, ",")) != NULL) {
		index = strsep(&bar, ":");
		size = strsep(&bar, ":");
		kind = strsep(&bar, ":");
		prefetch = strsep(&bar, ":");
		if (!size || !kind || bar || kstrtou32(index, 0, &i) || kstrtou64(size, 0, &bytes))
			return -EINVAL;
		if (strcmp(kind, "mem32") && strcmp(kind, "mem64") && strcmp(kind, "io"))
			return -EINVAL;
		if (prefetch && strcmp(prefetch, "prefetch"))
			return -EINVAL;
		used += scnprintf(out + used, len - used, "%u %#llx %s%s\n", i, bytes, kind,
				  prefetch ? " prefetch" : "");
		if (used >= len - 1)
			return -E2BIG;
	}
	return 0;
}

static int smartio_ctl_add(char **w)
{
	struct smartio_dev *sdev;
	struct device *dev;
	int ret;

	sdev = kzalloc(sizeof(*sdev), GFP_KERNEL);
	if (!sdev)
		return -ENOMEM;
	sdev->borrower = -1;
	INIT_LIST_HEAD(&sdev->shares);
	ret = -EINVAL;
	if (kstrtou32(w[0], 0, &sdev->fdid) || kstrtou32(w[1], 0, &sdev->lender_node_id) ||
	    kstrtou32(w[2], 0, &sdev->lender_adapter) ||
	    strscpy(sdev->lender_bdf, w[3], sizeof(sdev->lender_bdf)) < 0 ||
	    kstrtou32(w[4], 0, &sdev->vendor) || kstrtou32(w[5], 0, &sdev->device) ||
	    kstrtou32(w[6], 0, &sdev->class_code) || kstrtou32(w[7], 0, &sdev->dma_bits) ||
	    smartio_parse_availability(w[9], &sdev->availability))
		goto err;
	if (strcmp(w[8], "-")) {
		if (kstrtou32(w[8], 0, &sdev->physfn))
			goto err;
		sdev->has_physfn = true;
	}
	ret = smartio_parse_bars(w[10], sdev->bars, sizeof(sdev->bars));
	if (ret)
		goto err;
	mutex_lock(&smartio_lock);
	if (smartio_find(sdev->fdid)) {
		ret = -EEXIST;
	} else {
		dev = device_create_with_groups(&smartio_class, NULL, MKDEV(0, 0), sdev,
						smartio_dev_groups, "smartio-%x", sdev->fdid);
		ret = PTR_ERR_OR_ZERO(dev);
		if (!ret) {
			sdev->dev = dev;
			list_add_tail(&sdev->node, &smartio_devs);
		}
	}
	mutex_unlock(&smartio_lock);
	if (!ret)
		return 0;
err:
	kfree(sdev);
	return ret;
}

/* "INDEX MODEL WINDOW SEGMENTS LUT_ENTRIES LINK PEER|- PORT|-": one of this host's adapters. */
static int smartio_ctl_adapter(char **w)
{
	struct smartio_adapter *ad, *other;
	struct device *dev;
	char *peer_index;
	int ret;

	ad = kzalloc(sizeof(*ad), GFP_KERNEL);
	if (!ad)
		return -ENOMEM;
	ret = -EINVAL;
	if (kstrtou32(w[0], 0, &ad->index) || ad->index > 15 ||
	    strscpy(ad->model, w[1], sizeof(ad->model)) < 0 ||
	    kstrtou64(w[2], 0, &ad->window_size) || kstrtou32(w[3], 0, &ad->segments) ||
	    kstrtou32(w[4], 0, &ad->lut_entries))
		goto err;
	if (!strcmp(w[5], "up"))
		ad->link_up = true;
	else if (strcmp(w[5], "down"))
		goto err;
	if (strcmp(w[6], "-")) {
		peer_index = strchr(w[6], ':');
		if (!peer_index)
			goto err;
		*peer_index++ = '\0';
		if (kstrtou32(w[6], 0, &ad->peer_node) || kstrtou32(peer_index, 0, &ad->peer_index))
			goto err;
		ad->has_peer = true;
	}
	if (strcmp(w[7], "-")) {
		if (kstrtou32(w[7], 0, &ad->port))
			goto err;
		ad->has_port = true;
	}
	mutex_lock(&smartio_lock);
	ret = 0;
	list_for_each_entry(other, &smartio_adapters, node)
		if (other->index == ad->index)
			ret = -EEXIST;
	if (!ret) {
		dev = device_create_with_groups(&smartio_class, NULL, MKDEV(0, 0), ad,
						smartio_adapter_groups, "adapter%u", ad->index);
		ret = PTR_ERR_OR_ZERO(dev);
		if (!ret) {
			ad->dev = dev;
			list_add_tail(&ad->node, &smartio_adapters);
		}
	}
	mutex_unlock(&smartio_lock);
	if (!ret)
		return 0;
err:
	kfree(ad);
	return ret;
}

/* Every adapter leaves: their attributes take no lock, so they go under it. */
static void smartio_remove_adapters(void)
{
	struct smartio_adapter *ad, *next;

	list_for_each_entry_safe(ad, next, &smartio_adapters, node) {
		list_del(&ad->node);
		device_unregister(ad->dev);
		kfree(ad);
	}
}

/* Unregister the devices of @gone (taken off the list under the lock) without the lock: a
 * store on one of their attributes that waits for the lock would never let go of it.
 */
static void smartio_free(struct list_head *gone)
{
	struct smartio_dev *sdev, *next;

	struct smartio_share *sh, *shn;

	list_for_each_entry_safe(sdev, next, gone, node) {
		list_del(&sdev->node);
		device_unregister(sdev->dev);
		/* its children went with its parent: nothing adds a share any more */
		list_for_each_entry_safe(sh, shn, &sdev->shares, node)
			kfree(sh);
		kfree(sdev);
	}
}

static void smartio_leave(struct smartio_dev *sdev, struct list_head *gone)
{
	smartio_detach(sdev);
	sdev->gone = true;
	list_move_tail(&sdev->node, gone);
}

static int smartio_ctl(char *line)
{
	struct smartio_dev *sdev, *next;
	enum smartio_availability availability;
	LIST_HEAD(gone);
	char *w[12];
	int n, ret = 0, borrower;
	u32 fdid, qp, vectors;

	n = smartio_split(line, w, ARRAY_SIZE(w));
	if (n < 1)
		return -EINVAL;
	if (!strcmp(w[0], "add"))
		return n == 12 ? smartio_ctl_add(w + 1) : -EINVAL;
	if (!strcmp(w[0], "adapter"))
		return n == 9 ? smartio_ctl_adapter(w + 1) : -EINVAL;
	if (!strcmp(w[0], "reset")) {
		if (n != 1)
			return -EINVAL;
		mutex_lock(&smartio_lock);
		list_for_each_entry_safe(sdev, next, &smartio_devs, node)
			smartio_leave(sdev, &gone);
		smartio_remove_adapters();
		mutex_unlock(&smartio_lock);
		smartio_free(&gone);
		return 0;
	}
	if (n < 2 || kstrtou32(w[1], 0, &fdid))
		return -EINVAL;
	mutex_lock(&smartio_lock);
	sdev = smartio_find(fdid);
	if (!sdev)
		ret = -ENODEV;
	else if (!strcmp(w[0], "remove") && n == 2)
		smartio_leave(sdev, &gone);
	else if (!strcmp(w[0], "availability") && n == 3 &&
		 !smartio_parse_availability(w[2], &availability))
		smartio_set_availability(sdev, availability);
	else if (!strcmp(w[0], "borrower") && n == 3 && !kstrtoint(w[2], 0, &borrower) &&
		 borrower >= -1 && borrower != 0)
		smartio_set(sdev, sdev->availability, borrower);
	else if (!strcmp(w[0], "share") && n == 4 && !sdev->parent &&
		 !kstrtou32(w[2], 0, &qp) && !kstrtou32(w[3], 0, &vectors) && qp &&
		 vectors > 1) {
		/* section 7: the manager can run it; parents registered from now on offer
		 * smartio-nvme_share beside the contract's type (a refused line changes nothing) */
		sdev->share_queue_pairs = qp;
		sdev->share_vectors = vectors;
		WRITE_ONCE(sdev->shareable, true);
	} else
		ret = -EINVAL;
	mutex_unlock(&smartio_lock);
	smartio_free(&gone);
	return ret;
}

static ssize_t smartio_ctl_write(struct file *file, const char __user *ubuf, size_t len,
				 loff_t *ppos)
{
	char *buf;
	int ret;

	if (len > SMARTIO_CTL_MAX)
		return -EINVAL;
	buf = memdup_user_nul(ubuf, len);
	if (IS_ERR(buf))
		return PTR_ERR(buf);
	ret = smartio_ctl(buf);
	kfree(buf);
	return ret ? ret : len;
}

static const struct file_operations smartio_ctl_fops = {
	.owner = THIS_MODULE,
	.open = simple_open,
	.write = smartio_ctl_write,
#if LINUX_VERSION_CODE < KERNEL_VERSION(6, 12, 0)
	.llseek = no_llseek,
#endif
};

/* --- module --------------------------------------------------------------------------- */

static int __init smartio_init(void)
{
	int ret;

	if (!node_id || node_id > 0xffff)
		return -EINVAL;
	ret = class_register(&smartio_class);
	if (ret)
		return ret;
	smartio_debugfs = debugfs_create_dir("smartio", NULL);
	debugfs_create_file("ctl", 0200, smartio_debugfs, NULL, &smartio_ctl_fops);
	return 0;
}

static void __exit smartio_exit(void)
{
	struct smartio_dev *sdev, *next;
	LIST_HEAD(gone);

	debugfs_remove_recursive(smartio_debugfs);
	mutex_lock(&smartio_lock);
	list_for_each_entry_safe(sdev, next, &smartio_devs, node)
		smartio_leave(sdev, &gone);
	smartio_remove_adapters();
	mutex_unlock(&smartio_lock);
	smartio_free(&gone);
	class_unregister(&smartio_class);
}

module_init(smartio_init);
module_exit(smartio_exit);

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("vmlend kernel tier: a stand-in serving the SmartIO driver's sysfs contract");
