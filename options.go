package coord

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"math"
	"os"
	"strings"
	"time"
	"unicode/utf8"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Defaults, in one place. Every options struct's zero value takes these.
const (
	// HostsPrefix is the default prefix under which hosts register.
	HostsPrefix = "/coord/hosts/"
	// DefaultLivenessTTL is the default TTL of a host's lease.
	DefaultLivenessTTL = 10 * time.Second
	// DefaultElectionTTL is the default TTL of an election's session.
	DefaultElectionTTL = 10 * time.Second
	// DefaultPoolTTL is the default TTL of a pool's shared sessions.
	DefaultPoolTTL = 30 * time.Second
	// DefaultKeysPerSession is the default PoolOptions.KeysPerSession:
	// etcd applies a put in time linear in the keys already on its lease.
	DefaultKeysPerSession = 1000
	// DefaultMaxBacklog is the default WatcherOptions.MaxBacklog.
	DefaultMaxBacklog = 10000
	// DefaultWatcherPageSize is the default WatcherOptions.PageSize: a page
	// of 3,500 hosts with typical metadata (a UUID, a host name, a few
	// labels: some 280 bytes per host in etcd's response) is about 1 MB.
	DefaultWatcherPageSize = 3500
	// ShardsPrefix is the default prefix of a ShardSet's shard elections.
	ShardsPrefix = "/coord/shards/"
	// DefaultShardReplicas is the default ShardOptions.Replicas: an owner
	// and one standby per shard.
	DefaultShardReplicas = 2
	// DefaultShardMaxMoves is the default ShardOptions.MaxMoves.
	DefaultShardMaxMoves = 8
	// DefaultShardTTL is the default TTL of a ShardSet's shared sessions.
	DefaultShardTTL = 10 * time.Second
	// DefaultSemaphoreTTL is the default TTL of a Semaphore's session.
	DefaultSemaphoreTTL = 10 * time.Second

	// Heal backoff: capped exponential with jitter.
	minBackoff = 50 * time.Millisecond
	maxBackoff = 2 * time.Second
	// attemptTimeout is the least time a heal attempt is given.
	attemptTimeout = 2 * time.Second
	// compactedListings is how many paged listings in a row a watcher
	// sees compacted away before it lists in one read.
	compactedListings = 3
	// expirySlack is how late etcd may expire a lease after its TTL: its
	// lessor checks for expired leases every 500ms; the rest covers a
	// revoke's trip through raft.
	expirySlack = time.Second
	// checkTimeout bounds each check of a HealthHandler.
	checkTimeout = time.Second
)

// LivenessOptions configures RegisterHostLiveness. The zero value registers
// under HostsPrefix with DefaultLivenessTTL, refusing to take over a key held
// by another live lease.
type LivenessOptions struct {
	// Prefix under which the host key is written; must end in "/".
	// Default HostsPrefix.
	Prefix string
	// TTL of the host's lease: a whole number of seconds. Default 10s. etcd
	// may grant a longer one; HostLiveness.TTL reports the granted TTL.
	TTL time.Duration
	// Takeover overwrites a key held by another live lease at once instead
	// of waiting for it to expire.
	Takeover bool
	// Logger receives the registration's records; nil discards them.
	Logger *slog.Logger
	// OnSignal, if set, receives state changes and counts for metrics.
	OnSignal func(Signal)
}

// WatcherOptions configures NewHostWatcher. The zero value watches
// HostsPrefix, listing in pages of DefaultWatcherPageSize keys.
type WatcherOptions struct {
	// Prefix to watch; must end in "/". Default HostsPrefix.
	Prefix string
	// Self is this agent's own HostUUID: its events are not delivered and
	// it is left out of Hosts. Empty means none.
	Self string
	// Buffer has no effect: Events is unbuffered, so that Synced can tell
	// when the consumer has received the snapshot, and the events not
	// received yet queue in the watcher, in order, never dropped.
	// Negative is an error.
	//
	// Deprecated: leave it 0.
	Buffer int
	// MaxBacklog bounds the events queued for a consumer that does not
	// keep up, beyond twice the number of hosts it knows of: past it, the
	// queue is replaced by the differences between what the consumer was
	// sent and the current hosts (synthetic events). The consumer's replica
	// stays exact; it skips the intermediate states. 0 means
	// DefaultMaxBacklog; negative is an error.
	MaxBacklog int
	// PageSize bounds the keys of each response when the watcher lists
	// the prefix (at the start, and again after a compaction or a broken
	// watch): it reads them in pages, each at the revision of the first,
	// so that a listing is still one snapshot; a page whose revision was
	// compacted meanwhile starts the listing again. When 3 listings in a
	// row are compacted away, the watcher lists in one read instead (and
	// signals SignalWatcherListingCompacted): it syncs however often etcd
	// compacts. Smaller pages cost etcd more: for each page it counts the
	// keys left to the end of the prefix. 0 means DefaultWatcherPageSize;
	// negative is an error.
	PageSize int
	// UnhealthyAfter is how long the watcher may go without following
	// etcd (before its first listing, or listing again after its watch
	// broke) before Healthy reports it: a view older than a host's TTL
	// may miss its death. 0 means DefaultLivenessTTL; negative is an
	// error.
	UnhealthyAfter time.Duration
	// Logger receives the watcher's records; nil discards them.
	Logger *slog.Logger
	// OnSignal, if set, receives state changes and counts for metrics.
	OnSignal func(Signal)
}

// ElectionOptions configures NewElection. Key is required.
type ElectionOptions struct {
	// Key names the election: an etcd prefix, non-empty, with no trailing
	// "/" and no empty path element. Candidates are <Key>/<lease hex>.
	Key string
	// TTL of the election's session: a whole number of seconds. Default 10s.
	TTL time.Duration
	// Identity is the value proclaimed by Campaign and TryCampaign when they
	// are given "". Default: the host name.
	Identity string
	// WatchClient, if set, is the client of Observe's reads and watches:
	// a client of etcd's gRPC proxy where many processes observe one
	// election (docs/fleet.md). nil: the election's own client. A
	// campaign's reads and watches, its writes and its lease stay on the
	// election's client: they decide who leads, on etcd's own answers.
	WatchClient *clientv3.Client
	// Logger receives the election's records; nil discards them.
	Logger *slog.Logger
	// OnSignal, if set, receives state changes and counts for metrics.
	OnSignal func(Signal)
}

// SemaphoreOptions configures NewSemaphore. Key and Limit are required.
type SemaphoreOptions struct {
	// Key names the semaphore: an etcd prefix, as ElectionOptions.Key.
	// Key itself holds the Limit (a key without lease, written by the
	// first user); the permits are <Key>/<lease hex>-<n>.
	Key string
	// Limit is how many permits are held at once, fleet-wide: at least 1.
	// Every user of Key must ask for the same Limit.
	Limit int
	// TTL of the session holding our permits: a whole number of seconds.
	// Default 10s. A holder that crashes frees its slot once it expires.
	TTL time.Duration
	// Host, if set, is our registration: the permits ride its lease (and
	// its TTL). Key is then held by one pool or semaphore of the host at
	// a time (ErrInUse). When the registration leaves a lease (lost,
	// healed on a new one), the permits on it end; once it has ended for
	// good, Acquire returns ErrHostGone.
	Host *HostLiveness
	// Identity is shown to others as the holder of our permits. Default:
	// the host name.
	Identity string
	// Logger receives the semaphore's records; nil discards them.
	Logger *slog.Logger
	// OnSignal, if set, receives state changes and counts for metrics.
	OnSignal func(Signal)
}

// PoolOptions configures NewElectionPool. The zero value shares sessions
// of DefaultPoolTTL among up to DefaultKeysPerSession elections each.
type PoolOptions struct {
	// TTL of each shared session: a whole number of seconds. Default 30s.
	TTL time.Duration
	// Host, if set, is our registration: the elections ride its lease
	// (and its TTL), up to KeysPerSession of them, the others sessions of
	// the pool's own. An election key is then held by one pool or
	// semaphore of the host at a time (ErrInUse). When the registration
	// leaves a lease (lost, healed on a new one), the terms on it end;
	// once it has ended for good, Campaign returns ErrHostGone.
	Host *HostLiveness
	// Identity is the default identity of the pooled elections; default:
	// the host name.
	Identity string
	// KeysPerSession is how many elections share one session (one lease)
	// at most; 0 means DefaultKeysPerSession, negative is an error.
	KeysPerSession int
	// WatchClient, if set, is the client of the pooled elections'
	// Observe, as ElectionOptions.WatchClient.
	WatchClient *clientv3.Client
	// Logger receives the pool's records; nil discards them.
	Logger *slog.Logger
	// OnSignal, if set, receives state changes and counts for metrics.
	OnSignal func(Signal)
}

// ShardOptions configures NewShardSet. Shards, Run, and Host or Self are
// required; the other fields' zero values take the defaults.
type ShardOptions struct {
	// Shards names the shards: unique, each a clean key segment
	// (non-empty, without "/", not starting with "@", which the set's own
	// keys use). Every member of the fleet should list the same shards.
	Shards []string
	// Host is our registration: Self is its HostUUID and HostPrefix its
	// prefix. Our member key and shard elections (up to KeysPerSession)
	// ride its lease, and step down on its TTL; one set of a Prefix per
	// host (ErrInUse). When it ends for good (Stop, taken over), every
	// Run's ctx ends, we own nothing, and the set ends with ErrHostGone.
	Host *HostLiveness
	// Self is this host's HostUUID, registered (by RegisterHostLiveness)
	// under HostPrefix, when Host is nil: while its key is not there, we
	// own nothing.
	Self string
	// Run does a shard's work while we own it, in a goroutine of its own.
	// Its ctx ends when we must let go (context.Cause says why: see
	// ShardSet); we hand the shard over once Run returns.
	Run func(ctx context.Context, s Shard)
	// Prefix under which the shard elections live, one at Prefix+name;
	// must end in "/", apart from HostPrefix. Default ShardsPrefix.
	Prefix string
	// HostPrefix under which the hosts register; default HostsPrefix.
	HostPrefix string
	// WatchClient, if set, is the client of the set's watch of the
	// hosts (the live hosts it ranks): a client of etcd's gRPC proxy in a
	// fleet wider than one etcd's fan-out, where the host watches of every
	// member behind the proxy share one watch of etcd (docs/fleet.md).
	// nil: the set's own client. The watches of the members and of the
	// shards' candidates, the reads, the writes and the leases stay on the
	// set's client: a won shard runs only once those watches have reached
	// the revision it was won at, which takes etcd's progress
	// notifications, and a proxy does not answer a request for them.
	// Closing WatchClient ends the set, as closing the set's client does.
	WatchClient *clientv3.Client
	// Replicas is how many members campaign for each shard: the owner and
	// its standbys. 0 means DefaultShardReplicas; negative is an error.
	Replicas int
	// Weight is our capacity relative to the other members': a member of
	// weight 2 owns about twice the shards of one of weight 1. 0 means 1;
	// negative, NaN or infinite is an error.
	Weight float64
	// Zone is our failure domain: a shard's Replicas candidates are in
	// distinct zones while there are at least that many. Empty is a zone.
	Zone string
	// MaxMoves bounds the planned moves in flight at once: the shards we
	// campaign to take over from another live member, and those we hand
	// over to a better-ranked member in line (a drain, a member joining),
	// from a Run's ctx ending to our resign. A shard without an owner is
	// taken at once. 0 means DefaultShardMaxMoves; negative is an error.
	MaxMoves int
	// Settle is how long no member may have joined before we campaign
	// for a shard we do not hold yet: a fleet starting, or a rolling
	// restart, is ranked once it has settled, not at each join, and a
	// shard moves once, not at every join. A member leaving does not
	// wait: its standbys are in line already, or, if not, the next-ranked
	// member campaigns at once. 0 means a tenth of the TTL; negative is an
	// error.
	Settle time.Duration
	// TTL of the shared sessions of the shard elections (with Host, of
	// those beyond its lease), and of the set's other timings: a whole
	// number of seconds. Default 10s.
	TTL time.Duration
	// KeysPerSession is how many shard elections share one session at
	// most; 0 means DefaultKeysPerSession, negative is an error.
	KeysPerSession int
	// Logger receives the shard set's records; nil discards them.
	Logger *slog.Logger
	// OnSignal, if set, receives state changes and counts for metrics:
	// the shard set's, its elections' and its host watcher's.
	OnSignal func(Signal)
}

// Each options struct checks itself, one message per check, and applies
// its defaults (withDefaults): what can be checked without etcd, before
// anything is written.

// withDefaults checks o and applies its defaults.
func (o LivenessOptions) withDefaults() (LivenessOptions, error) {
	var err error
	if o.Prefix, err = prefixOrDefault(o.Prefix); err != nil {
		return o, err
	}
	o.TTL, err = ttlOrDefault(o.TTL, DefaultLivenessTTL)
	return o, err
}

// withDefaults checks o and applies its defaults.
func (o WatcherOptions) withDefaults() (WatcherOptions, error) {
	var err error
	if o.Prefix, err = prefixOrDefault(o.Prefix); err != nil {
		return o, err
	}
	for _, c := range []struct {
		name string
		n    int
	}{{"Buffer", o.Buffer}, {"MaxBacklog", o.MaxBacklog}, {"PageSize", o.PageSize}} {
		if c.n < 0 {
			return o, fmt.Errorf("%w: %s %d (want >= 0)", ErrInvalidBuffer, c.name, c.n)
		}
	}
	if o.UnhealthyAfter < 0 {
		return o, fmt.Errorf("%w: UnhealthyAfter %v (want >= 0)", ErrInvalidTTL, o.UnhealthyAfter)
	}
	o.PageSize = cmp.Or(o.PageSize, DefaultWatcherPageSize)
	o.MaxBacklog = cmp.Or(o.MaxBacklog, DefaultMaxBacklog)
	o.UnhealthyAfter = cmp.Or(o.UnhealthyAfter, DefaultLivenessTTL)
	return o, nil
}

// withDefaults checks o and applies its defaults.
func (o ElectionOptions) withDefaults() (ElectionOptions, error) {
	if err := checkElectionKey(o.Key); err != nil {
		return o, err
	}
	var err error
	o.TTL, err = ttlOrDefault(o.TTL, DefaultElectionTTL)
	return o, err
}

// withDefaults checks o and applies its defaults.
func (o SemaphoreOptions) withDefaults() (SemaphoreOptions, error) {
	if err := checkKey("semaphore", o.Key); err != nil {
		return o, err
	}
	if o.Limit < 1 {
		return o, fmt.Errorf("%w: %d (want at least 1)", ErrInvalidLimit, o.Limit)
	}
	var err error
	o.TTL, err = ttlOrDefault(o.TTL, DefaultSemaphoreTTL)
	return o, err
}

// withDefaults checks o and applies its defaults.
func (o PoolOptions) withDefaults() (PoolOptions, error) {
	var err error
	if o.TTL, err = ttlOrDefault(o.TTL, DefaultPoolTTL); err != nil {
		return o, err
	}
	if o.KeysPerSession < 0 {
		return o, fmt.Errorf("%w: %d (want >= 0)", ErrInvalidKeysPerSession, o.KeysPerSession)
	}
	o.KeysPerSession = cmp.Or(o.KeysPerSession, DefaultKeysPerSession)
	return o, nil
}

// withDefaults checks o and applies its defaults.
func (o ShardOptions) withDefaults() (ShardOptions, error) {
	switch {
	case len(o.Shards) == 0:
		return o, fmt.Errorf("%w: no Shards", ErrInvalidShards)
	case o.Run == nil:
		return o, fmt.Errorf("%w: no Run", ErrInvalidShards)
	case o.Replicas < 0:
		return o, fmt.Errorf("%w: Replicas %d (want >= 0)", ErrInvalidShards, o.Replicas)
	case o.MaxMoves < 0:
		return o, fmt.Errorf("%w: MaxMoves %d (want >= 0)", ErrInvalidShards, o.MaxMoves)
	case o.Settle < 0:
		return o, fmt.Errorf("%w: Settle %v (want >= 0)", ErrInvalidShards, o.Settle)
	case o.Weight < 0 || math.IsNaN(o.Weight) || math.IsInf(o.Weight, 0):
		return o, fmt.Errorf("%w: Weight %v (want a finite number >= 0)", ErrInvalidShards, o.Weight)
	}
	if h := o.Host; h != nil {
		prefix := strings.TrimSuffix(h.key, h.id)
		if o.Self != "" && o.Self != h.id {
			return o, fmt.Errorf("%w: Self %q is not Host's HostUUID %q", ErrInvalidShards, o.Self, h.id)
		}
		if o.HostPrefix != "" && o.HostPrefix != prefix {
			return o, fmt.Errorf("%w: HostPrefix %q is not Host's prefix %q", ErrInvalidShards, o.HostPrefix, prefix)
		}
		o.Self, o.HostPrefix = h.id, prefix
	}
	o.Weight = cmp.Or(o.Weight, 1)
	o.MaxMoves = cmp.Or(o.MaxMoves, DefaultShardMaxMoves)
	if checkHostUUID(o.Self) != nil {
		return o, fmt.Errorf("%w: Self %q (want a HostUUID: non-empty UTF-8, without \"/\")", ErrInvalidShards, o.Self)
	}
	seen := map[string]bool{}
	for _, name := range o.Shards {
		if err := checkShardName(name); err != nil {
			return o, err
		}
		if seen[name] {
			return o, fmt.Errorf("%w: shard %q named twice", ErrInvalidShards, name)
		}
		seen[name] = true
	}
	o.Replicas = cmp.Or(o.Replicas, DefaultShardReplicas)
	o.Prefix = cmp.Or(o.Prefix, ShardsPrefix)
	o.HostPrefix = cmp.Or(o.HostPrefix, HostsPrefix)
	// Election keys must be clean, and a shard's candidates must never be
	// read as hosts, nor hosts as candidates.
	if !strings.HasSuffix(o.Prefix, "/") || strings.Contains(o.Prefix, "//") {
		return o, fmt.Errorf("%w: shard prefix %q (want it to end in \"/\", without \"//\")", ErrInvalidKey, o.Prefix)
	}
	if strings.HasPrefix(o.Prefix, o.HostPrefix) || strings.HasPrefix(o.HostPrefix, o.Prefix) {
		return o, fmt.Errorf("%w: shard prefix %q overlaps host prefix %q", ErrInvalidKey, o.Prefix, o.HostPrefix)
	}
	ttl, err := ttlOrDefault(o.TTL, DefaultShardTTL)
	o.TTL = ttl
	o.Settle = cmp.Or(o.Settle, ttl/10)
	return o, err
}

// discard is the logger used when none is given: it is enabled at no
// level, so no record is even built.
var discard = slog.New(slog.DiscardHandler)

func logger(l *slog.Logger) *slog.Logger {
	if l == nil {
		return discard
	}
	return l
}

// ttlOrDefault checks a TTL option and applies its default.
func ttlOrDefault(ttl, def time.Duration) (time.Duration, error) {
	switch {
	case ttl == 0:
		return def, nil
	case ttl < 0 || ttl%time.Second != 0:
		return 0, fmt.Errorf("%w: %v (want a positive whole number of seconds)", ErrInvalidTTL, ttl)
	}
	return ttl, nil
}

// prefixOrDefault checks a prefix option and applies its default.
func prefixOrDefault(prefix string) (string, error) {
	if prefix == "" {
		return HostsPrefix, nil
	}
	if !strings.HasSuffix(prefix, "/") {
		return "", fmt.Errorf("%w: prefix %q must end in \"/\"", ErrInvalidKey, prefix)
	}
	return prefix, nil
}

// checkHostUUID checks that id can name a key under a prefix, and be
// carried by the JSON of HostMetadata: JSON strings are UTF-8, so a
// HostUUID that is not would come back altered, and name another key.
func checkHostUUID(id string) error {
	if id == "" || strings.Contains(id, "/") || !utf8.ValidString(id) {
		return fmt.Errorf("%w: %q (want non-empty UTF-8, without \"/\")", ErrInvalidHostUUID, id)
	}
	return nil
}

// checkElectionKey checks that key is a clean etcd prefix.
func checkElectionKey(key string) error { return checkKey("election", key) }

// checkKey checks that the key of what (an election, a semaphore) is a
// clean etcd prefix.
func checkKey(what, key string) error {
	if key == "" || strings.HasSuffix(key, "/") || strings.Contains(key, "//") {
		return fmt.Errorf("%w: %s key %q (want non-empty, no trailing \"/\", no \"//\")", ErrInvalidKey, what, key)
	}
	return nil
}

// checkShardName checks that a shard name is a clean key segment.
func checkShardName(name string) error {
	if name == "" || strings.Contains(name, "/") || strings.HasPrefix(name, "@") {
		return fmt.Errorf("%w: shard %q (want non-empty, without \"/\", not starting with \"@\")", ErrInvalidShards, name)
	}
	return nil
}

func identityOrDefault(id string) string {
	if id != "" {
		return id
	}
	h, _ := os.Hostname()
	return h
}
