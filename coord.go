// Package coord gives a fleet of agents the primitives to coordinate
// high-availability work across hosts, on etcd v3: host liveness, a watcher
// of the live hosts, per-key leader election (an Election, or many sharing
// their sessions in an ElectionPool), and a ShardSet, which spreads work
// split into named shards over the live hosts, each shard owned by one host
// at a time and handed over without overlap, and a Semaphore, N fenced
// permits fleet-wide.
//
// The caller owns the *clientv3.Client: coord never dials, never closes it
// and opens no connection of its own. Closing the client ends everything
// built on it.
//
// # Key layout
//
// A host lives at <prefix><HostUUID> (prefix HostsPrefix, "/coord/hosts/", by
// default), its value the JSON of HostMetadata, attached to the host's lease.
// A prefix ends in "/"; the prefix key itself is never a host.
//
// An election is an etcd-concurrency election on its key K: candidates are
// K/<lease id in hex>, the leader is the candidate with the lowest create
// revision. Programs using go.etcd.io/etcd/client/v3/concurrency and
// "etcdctl elect K" take part in the same elections. Election keys must not be
// nested in one another (K and K/x), as in etcd's own package.
//
// A ShardSet's shard is such an election at <prefix><name> (prefix
// ShardsPrefix, "/coord/shards/", by default): its candidates are
// /coord/shards/<name>/<lease id in hex>, each holding its host's HostUUID,
// and its owner is the candidate with the lowest create revision. Every host
// registered under the ShardSet's HostPrefix is ranked for the shards.
//
// A semaphore on key K stores its Limit at K (a decimal, without lease);
// its permits are K/<lease id in hex>-<n>, each holding its holder's
// identity, and the first Limit of them by create revision are held. An
// Election is a semaphore of one: both run the same candidacies.
//
// # Guarantees
//
//   - A registered host's key exists while its process renews the lease; when
//     the process dies the key goes once the lease expires (TTL plus etcd's
//     expiry check, up to about 500ms), and at once after Stop.
//   - A registration heals by itself: if its lease expires or is revoked, or
//     its key is deleted, it registers again under a new lease with the latest
//     metadata. It never overwrites a key held by another lease: it ends with
//     ErrHostExists instead.
//   - A HostWatcher's events let a consumer keep an exact replica of the set
//     of hosts: a snapshot, then every change, with no gap and no duplicate,
//     across compactions, broken watches, etcd restarts and partitions (after
//     which only the differences are emitted, as synthetic events). Its
//     Synced closes only once the consumer has received the snapshot: a
//     select on Events and Synced never sees Synced first.
//   - At most one candidate of an election believes it leads at a time,
//     provided clocks run at the same rate: a leader steps down (Done
//     closes, IsLeader and Token turn false and 0) once two thirds of the TTL
//     have passed since the send of the last renewal etcd answered, before
//     etcd can expire its lease, however the link fails (silent, failing fast
//     then silent, slow answers) and even if the process was paused: IsLeader
//     is judged at the call on the monotonic clock. Fencing tokens of
//     successive leaders strictly increase; Guard turns that into a Txn
//     condition. A leader that stepped down, its lease and key alive, is
//     still the one ahead in etcd: a Campaign pending when etcd answers
//     again resumes it with the same token, and nobody led in between.
//   - Never more than Limit permits of a semaphore are held at once, by the
//     same rule: a permit cut off from etcd ends before etcd can expire it.
//   - Every call given a ctx returns within it; cleanup that must outlive it
//     (withdrawing a candidate key, revoking a lease) goes on in the
//     background, bounded by the TTL.
//
// # Not guaranteed
//
//   - A consumer that does not read is not sent every change: events queue
//     in memory, in order, and past WatcherOptions.MaxBacklog the queue is
//     replaced by the differences that bring the consumer up to date.
//   - A connection that goes silent without closing (a half-open TCP link)
//     is only noticed by the etcd client if it sets DialKeepAliveTime and
//     DialKeepAliveTimeout; until then watches wait. Healthy says so: a
//     HostWatcher's asks etcd where its watch stands while nothing comes,
//     and registrations, elections, semaphores and shard sets see their
//     renewals go unanswered.
//   - A watcher sees states, not every write: a value that is not valid
//     HostMetadata JSON counts as no host (it is logged and skipped).
//   - Leadership is a lease, not a lock on the world: act on etcd under
//     Guard, or check Done, to fence work done elsewhere.
//   - A write the client reported as failed may still land: a Txn whose
//     answer was lost (context canceled, deadline exceeded, connection
//     reset, "request timed out") can be applied seconds later, after
//     Run has returned or Done has closed. Guard still decides it at the
//     revision etcd applies it: it lands only if the term held then. Make
//     such writes idempotent (keyed by what they do, not by when), or
//     read back before acting on a failure.
package coord

import (
	"encoding/json"
	"fmt"
	"strings"
)

// HostMetadata is what a host publishes about itself, as JSON, at its key.
type HostMetadata struct {
	HostUUID   string            `json:"host_uuid"`
	Hostname   string            `json:"hostname,omitempty"`
	Hypervisor string            `json:"hypervisor,omitempty"`
	Version    string            `json:"version,omitempty"`
	StartedAt  int64             `json:"started_at_unix_ns,omitempty"`
	Labels     map[string]string `json:"labels,omitempty"`
}

// decodeHost decodes the value found at key under prefix. A value that is
// not HostMetadata JSON, or names another host than its key, is an error.
func decodeHost(prefix string, key, value []byte) (HostMetadata, error) {
	id := strings.TrimPrefix(string(key), prefix)
	var m HostMetadata
	if err := checkHostUUID(id); err != nil {
		return m, err
	}
	if err := json.Unmarshal(value, &m); err != nil {
		return m, opErr(fmt.Sprintf("decode host %q", id), err)
	}
	if m.HostUUID != id {
		return m, fmt.Errorf("coord: decode host %q: value names host %q", id, m.HostUUID)
	}
	return m, nil
}
