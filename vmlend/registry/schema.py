"""The state database's identity and schema, and the migrations between schema versions.

Pure data: no connections here. A new schema version appends a migration; nothing is ever
edited in place, so any older state file can be brought forward step by step.
"""

from __future__ import annotations

#: ``PRAGMA application_id`` of a vmlend state file: "vmLd" in ASCII. Marks the file as ours.
APPLICATION_ID = 0x766D4C64

#: The schema version this code writes (stored in ``meta``).
SCHEMA_VERSION = 7

#: The version of the etcd layout (``etcd_keys``), in its ``meta/schema_version`` key. It was
#: SQLite's until version 2; SQLite's version 3 adds a column, while etcd's topology record only
#: gained an optional key that older readers ignore. Version 3: the topology in generations of
#: pieces (``topopieces``) instead of one record an older vmlend would look for; a version-2
#: layout is still read (its record), and installing a topology writes version 3. Version 4:
#: generations of format 2 (read and verified a chunk at a time), which an older vmlend cannot
#: read; a version-3 layout is still read (whole), ``vmlend registry upgrade`` rewrites it.
#: Version 5: a hold's claims kept in its VM's ledger and on its unit blocks (no ``claims/``
#: key per claim, no ``held-on/`` index); an older layout is opened only to be upgraded.
#: Version 6: a node's own places (its adapters, the switch ports toward them) decided for
#: its VMs by one process at a time, within the node's extents (``decider/<node>/``), with
#: no unit block of a VM there; a vmlend of layout 5 would take blocks there unseen, so it is
#: refused, and an older layout is opened only to be upgraded.
#: Version 7: a lent device's requester entries (on its lender's adapter and the switch port
#: toward it) are its lender's lent entries, set aside at its first borrow and listed in its
#: record, which its holds use with no block of their VM; a vmlend of layout 6 would not
#: count them, so it is refused.
#: Version 8: a VM's units on an adapter may be a run, an aligned block less its last units
#: (``<start>/<size>/<free>``: a DMA window of 5 segments one key, not 4+1), which a vmlend of
#: layout 7 neither parses nor compares when it takes units inside that block; it is refused.
ETCD_SCHEMA_VERSION = 8

#: The oldest etcd layout whose holds and claims this vmlend reads: a cluster of an older one
#: is opened by ``vmlend registry upgrade`` only.
ETCD_HOLDS_LAYOUT = 8

#: Version 1: the first schema. Fdids are INTEGERs, times are UNIX seconds (REAL).
SCHEMA_V1 = """
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
-- The topology: the text it came from and how to re-parse it. Exactly one row.
CREATE TABLE topology (
    id         INTEGER PRIMARY KEY CHECK (id = 1),
    name       TEXT NOT NULL,
    source     TEXT NOT NULL,
    text       TEXT NOT NULL,
    digest     TEXT NOT NULL,
    local_node TEXT NOT NULL,
    created    REAL NOT NULL
);
CREATE TABLE nodes (
    name TEXT PRIMARY KEY,
    up   INTEGER NOT NULL DEFAULT 1,
    why  TEXT NOT NULL DEFAULT ''
);
CREATE TABLE devices (
    fdid      INTEGER PRIMARY KEY,
    lender    TEXT NOT NULL REFERENCES nodes (name),
    lent      INTEGER NOT NULL,
    available INTEGER NOT NULL DEFAULT 1
);
-- Who holds a device. At most one holder per device: the primary key is the lock.
CREATE TABLE holds (
    fdid      INTEGER PRIMARY KEY REFERENCES devices (fdid),
    node      TEXT NOT NULL,
    vm        TEXT NOT NULL,
    vm_uuid   TEXT NOT NULL DEFAULT '',
    since     REAL NOT NULL,
    phase     TEXT NOT NULL CHECK (phase IN ('reserved', 'borrowed')),
    guest_ram INTEGER NOT NULL DEFAULT 0
);
-- Adapter resources a hold uses. Rows with the same (adapter, kind, share) are one resource
-- shared by several holds (a VM's DMA windows through one lender adapter).
CREATE TABLE claims (
    fdid     INTEGER NOT NULL REFERENCES holds (fdid) ON DELETE CASCADE,
    adapter  TEXT NOT NULL,
    kind     TEXT NOT NULL CHECK (kind IN ('lut', 'dma', 'bar')),
    share    TEXT NOT NULL,
    entries  INTEGER NOT NULL DEFAULT 0,
    segments INTEGER NOT NULL DEFAULT 0,
    bytes    INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX claims_adapter ON claims (adapter);
CREATE TABLE mdev_parents (
    node TEXT NOT NULL,
    fdid INTEGER NOT NULL REFERENCES devices (fdid),
    name TEXT NOT NULL,
    PRIMARY KEY (node, fdid)
);
CREATE TABLE mdevs (
    uuid    TEXT PRIMARY KEY,
    fdid    INTEGER NOT NULL REFERENCES devices (fdid),
    node    TEXT NOT NULL,
    parent  TEXT NOT NULL,
    type_id TEXT NOT NULL,
    vm      TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL
);
-- What the data path set up for a held device (DMA windows, interrupt vectors, P2P maps),
-- so 'vmlend status' in another process can show it. It goes with the hold.
CREATE TABLE runtime (
    fdid INTEGER NOT NULL REFERENCES holds (fdid) ON DELETE CASCADE,
    kind TEXT NOT NULL,
    key  TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (fdid, kind, key)
);
"""

#: Version 2: claims of kind 'p2p' (peer-to-peer among a VM's devices is admitted). SQLite
#: cannot change a CHECK constraint, so the claims table is rebuilt with its rows.
MIGRATE_V1_V2 = (
    """CREATE TABLE claims_v2 (
    fdid     INTEGER NOT NULL REFERENCES holds (fdid) ON DELETE CASCADE,
    adapter  TEXT NOT NULL,
    kind     TEXT NOT NULL CHECK (kind IN ('lut', 'dma', 'bar', 'p2p')),
    share    TEXT NOT NULL,
    entries  INTEGER NOT NULL DEFAULT 0,
    segments INTEGER NOT NULL DEFAULT 0,
    bytes    INTEGER NOT NULL DEFAULT 0
)""",
    "INSERT INTO claims_v2 (fdid, adapter, kind, share, entries, segments, bytes)"
    " SELECT fdid, adapter, kind, share, entries, segments, bytes FROM claims",
    "DROP TABLE claims",
    "ALTER TABLE claims_v2 RENAME TO claims",
    "CREATE INDEX claims_adapter ON claims (adapter)",
)

#: Version 3: the topology's compiled form next to its text (``vmlend.topology.compiled``), so
#: opening a fabric parses no TOML. NULL: not compiled yet, the text is parsed as before; the
#: next ``vmlend fabric init`` compiles it.
MIGRATE_V2_V3 = ("ALTER TABLE topology ADD COLUMN compiled BLOB",)
#: The first version with that column. A version-2 state this process may not write is read
#: without it rather than refused (read-only commands keep working on a read-only state).
COMPILED_SINCE = 3

#: Version 4: each hold's fencing token (``HoldRecord.token``), from a counter of the state
#: (``meta.hold_token``), so the device's side can refuse a step made for an older hold.
#: Holds made before it have token 0 (not checked).
MIGRATE_V3_V4 = (
    "ALTER TABLE holds ADD COLUMN token INTEGER NOT NULL DEFAULT 0",
    "INSERT OR IGNORE INTO meta (key, value) VALUES ('hold_token', '0')",
)
#: The first version with that column (a read-only older state is read without it).
TOKEN_SINCE = 4

#: Version 5: an index of the topology's digest, which every transaction reads to learn
#: whether the topology changed. The digest sits after the TOML text in the row, so reading
#: it from the table walks the text's overflow pages: 0.7 ms a transaction for a 1,024-node
#: fabric's 3 MB. The index covers ``SELECT digest FROM topology`` (one row): 0.005 ms.
#: And indexes of what a reserve looks holds and claims up by besides their keys: a VM's holds
#: by node (``holds_of``), a hold's claims by fdid (``replace_claims``, the cascade of a
#: release), which scanned every hold and claim of the fabric, so that a reserve among
#: 16,000 holds cost six times one among none.
MIGRATE_V4_V5 = (
    "CREATE INDEX topology_digest ON topology (digest)",
    "CREATE INDEX holds_node ON holds (node)",
    "CREATE INDEX claims_fdid ON claims (fdid)",
)

#: Version 6: the topology in generations of pieces (``vmlend.registry.topopieces``), as in
#: etcd: the row's ``head`` names the generation whose pieces hold the text, the compiled form
#: and the initial node and device states, verified by their sha256 when read. NULL: the row's
#: own ``text`` and ``compiled`` hold the topology (written before version 6; the next
#: ``vmlend fabric init --replace`` writes a generation). A version-5 state this process may
#: not write is read as it is.
MIGRATE_V5_V6 = (
    """CREATE TABLE topology_pieces (
    generation TEXT NOT NULL,
    n          INTEGER NOT NULL,
    data       BLOB NOT NULL,
    PRIMARY KEY (generation, n)
)""",
    "ALTER TABLE topology ADD COLUMN head TEXT",
)
#: The first version with the head (a read-only older state is read without it).
HEAD_SINCE = 6

#: Version 7: no table changes; the topology's generation is written again in format 2
#: (``topopieces``: addressable, verified a chunk at a time, so that a process reads the few
#: kilobytes it uses from this host's copy instead of every piece) by
#: ``SqliteTxn.rewrite_topology_generation``, which ``SqliteRegistry._migrate`` runs after
#: this step's (empty) statements; a topology still kept in the row (schema 5 and before) has
#: its compiled form compiled again there. A version-6 state this process may not write is
#: read as it is (its generation whole, its compiled form, of format 6, not used: its text is
#: parsed).
MIGRATE_V6_V7: tuple[str, ...] = ()
#: The version whose step rewrites the generation.
GENERATION_2_SINCE = 7

#: ``MIGRATIONS[n]`` takes a version-``n`` database to version ``n + 1``. A new state file is
#: created as version 1 and brought forward by the same steps, so both paths give one schema.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: MIGRATE_V1_V2,
    2: MIGRATE_V2_V3,
    3: MIGRATE_V3_V4,
    4: MIGRATE_V4_V5,
    5: MIGRATE_V5_V6,
    6: MIGRATE_V6_V7,
}

#: Tables a vmlend state file has; anything else under our application_id is suspicious.
TABLES = frozenset(
    {
        "meta",
        "topology",
        "topology_pieces",
        "nodes",
        "devices",
        "holds",
        "claims",
        "mdev_parents",
        "mdevs",
        "runtime",
    }
)
