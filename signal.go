package coord

import (
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// SignalKind says what a Signal reports.
type SignalKind int

// The kinds of signals. Each says which fields it sets, after the
// convention of Signal.
const (
	// SignalRegistered: a host registration holds its key under Lease;
	// Attempt is 0 for the first registration, the heal attempt after.
	SignalRegistered SignalKind = iota
	// SignalHealAttempt: a heal attempt failed with Err and will be retried.
	SignalHealAttempt
	// SignalRegistrationEnded: a registration ended for good; Err is why,
	// as HostLiveness.Err says it: nil after Stop, ErrHostExists when
	// taken over, ErrClientClosed, a refusal.
	SignalRegistrationEnded
	// SignalLeadershipGained: we lead election Key as Identity with
	// fencing Token.
	SignalLeadershipGained
	// SignalLeadershipLost: our leadership of Key with Token ended; Err is
	// why, as Election.Err says it: ErrResigned, ErrClosed,
	// ErrClientClosed, or ErrLeadershipLost wrapping the cause (renewals
	// unanswered, lease expired or revoked, key deleted or written off our
	// lease).
	SignalLeadershipLost
	// SignalWatcherResync: a watcher re-listed its prefix (Key) after its
	// watch broke, or caught up a consumer that fell behind; Count is the
	// number of synthetic events that made up the difference.
	SignalWatcherResync
	// SignalEventDelivered: a watcher of Key handed an event of kind Event
	// about Host to its consumer.
	SignalEventDelivered
	// SignalShardAcquired: we (Host) own Shard, whose election is Key,
	// with fencing Token; its Run starts.
	SignalShardAcquired
	// SignalShardReleased: our (Host's) Run of Shard with Token returned;
	// Drain is how long it took after its ctx ended, Err why that ctx
	// ended, as context.Cause of Run's ctx says it (nil if Run returned
	// first). The shard is handed over next.
	SignalShardReleased
	// SignalWatcherListingCompacted: a watcher's paged listing of Key was
	// compacted away Count times in a row (etcd compacts faster than the
	// pages come); it lists the prefix in one read instead.
	SignalWatcherListingCompacted
	// SignalPermitAcquired: we hold a permit of semaphore Key as Identity
	// with fencing Token.
	SignalPermitAcquired
	// SignalPermitReleased: our permit of semaphore Key with Token ended;
	// Err is why, as Permit.Err says it: ErrReleased, ErrClosed,
	// ErrClientClosed, or ErrPermitLost wrapping the cause.
	SignalPermitReleased
	// SignalEtcdReplaced: the etcd behind Key was found replaced or
	// restored, from its answers: another cluster ID, or a revision below
	// one seen. Err says the old and new cluster ID and revision. A
	// watcher (Key its prefix) or a shard set (its Prefix; Host) lists
	// everything under Key again; a registration (its host key; Host) has
	// healed on the new etcd; an election, a pool or a semaphore (Key that
	// of its first campaign or acquire to hear it) queues again there,
	// its tokens started over.
	SignalEtcdReplaced
	// SignalLeadershipResumed: we lead election Key as Identity again,
	// with the same fencing Token, after a step-down for unanswered
	// renewals: the lease and our key lived on (see Election.Campaign).
	SignalLeadershipResumed
	// SignalPermitResumed: we hold a permit of semaphore Key as Identity
	// again, with the same fencing Token, after a step-down for
	// unanswered renewals (see Semaphore.Acquire).
	SignalPermitResumed
)

var signalNames = [...]string{"registered", "heal-attempt", "registration-ended",
	"leadership-gained", "leadership-lost", "watcher-resync", "event-delivered",
	"shard-acquired", "shard-released", "watcher-listing-compacted", "permit-acquired", "permit-released", "etcd-replaced",
	"leadership-resumed", "permit-resumed"}

// String returns the signal kind's name, e.g. "leadership-lost".
func (k SignalKind) String() string {
	if k < 0 || int(k) >= len(signalNames) {
		return fmt.Sprintf("SignalKind(%d)", int(k))
	}
	return signalNames[k]
}

// A Signal reports a state change or a count, for an agent's metrics: set
// OnSignal in the options of what you build to receive them, and feed
// Prometheus, OpenTelemetry or anything else from there — coord imports
// none of them.
//
// Every kind follows one convention:
//   - Key is always the full etcd key or prefix of what the signal is
//     about: a registration's host key, a watcher's prefix, an election's
//     or semaphore's key, a shard's election key (ShardOptions.Prefix +
//     name; Shard holds the bare name).
//   - Host is the HostUUID of the host the signal is about wherever coord
//     knows one: the registration's, the host of a delivered event, the
//     ShardSet's own. Elections and semaphores know no HostUUID, and a
//     watcher's resyncs are about its whole prefix: Host is empty there.
//   - A term (a leadership, a permit, a shard's ownership) carries its
//     fencing Token and the Identity it was gained as (a ShardSet's is
//     its HostUUID).
//   - A signal that says something failed or ended carries the cause in
//     Err, as the object's Err says it; nil only where that is nil (a
//     registration stopped, a Run that returned by itself).
//
// Fields that do not apply to a kind are left zero.
type Signal struct {
	Kind     SignalKind
	Key      string           // the full etcd key or prefix the signal is about
	Host     string           // the HostUUID it is about, where coord knows one
	Identity string           // the identity a term was gained as
	Shard    string           // the shard's name
	Lease    clientv3.LeaseID // lease of a registration
	Token    int64            // fencing token of a term
	Attempt  int              // heal attempt
	Count    int              // synthetic events of a resync; listings compacted away
	Event    HostEventKind    // kind of a delivered event
	Err      error            // why it failed or ended
	Drain    time.Duration    // how long a shard's Run took to return after its ctx ended
}

// emit hands s to fn, if there is one. fn runs on coord's goroutines: it
// must be quick and must not call back into what sent the signal.
func emit(fn func(Signal), s Signal) {
	if fn != nil {
		fn(s)
	}
}
