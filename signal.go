package coord

import (
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// SignalKind says what a Signal reports.
type SignalKind int

// The kinds of signals.
const (
	// SignalRegistered: a host registration holds its key under Lease;
	// Attempt is 0 for the first registration, the heal attempt after.
	SignalRegistered SignalKind = iota
	// SignalHealAttempt: a heal attempt failed with Err and will be retried.
	SignalHealAttempt
	// SignalRegistrationEnded: a registration ended for good; Err is nil
	// after Stop.
	SignalRegistrationEnded
	// SignalLeadershipGained: we lead election Key with fencing Token.
	SignalLeadershipGained
	// SignalLeadershipLost: our leadership of Key with Token ended, for
	// any reason (Resign, expiry, step-down, key deleted, Close).
	SignalLeadershipLost
	// SignalWatcherResync: a watcher re-listed its prefix (Key) after its
	// watch broke, or caught up a consumer that fell behind; Count is the
	// number of synthetic events that made up the difference.
	SignalWatcherResync
	// SignalEventDelivered: a watcher of Key handed an event of kind Event
	// about Host to its consumer.
	SignalEventDelivered
	// SignalShardAcquired: we (Host) own shard Key with fencing Token;
	// its Run starts.
	SignalShardAcquired
	// SignalShardReleased: our (Host's) Run of shard Key with Token
	// returned; Drain is how long it took after its ctx ended, Err why
	// that ctx ended (nil if Run returned first). The shard is handed
	// over next.
	SignalShardReleased
	// SignalWatcherListingCompacted: a watcher's paged listing of Key was
	// compacted away Count times in a row (etcd compacts faster than the
	// pages come); it lists the prefix in one read instead.
	SignalWatcherListingCompacted
	// SignalPermitAcquired: we hold a permit of semaphore Key with
	// fencing Token.
	SignalPermitAcquired
	// SignalPermitReleased: our permit of semaphore Key with Token ended,
	// for any reason (Release, expiry, step-down, key deleted, Close).
	SignalPermitReleased
)

var signalNames = [...]string{"registered", "heal-attempt", "registration-ended",
	"leadership-gained", "leadership-lost", "watcher-resync", "event-delivered",
	"shard-acquired", "shard-released", "watcher-listing-compacted", "permit-acquired", "permit-released"}

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
// none of them. Only the fields that make sense for the Kind are set.
type Signal struct {
	Kind    SignalKind
	Host    string           // host UUID
	Key     string           // host key, election or semaphore key, watched prefix, or shard name
	Lease   clientv3.LeaseID // lease of a registration
	Token   int64            // fencing token of a leadership or a permit
	Attempt int              // heal attempt
	Count   int              // synthetic events of a resync; listings compacted away
	Event   HostEventKind    // kind of a delivered event
	Err     error            // why, where there is a why
	Drain   time.Duration    // how long a shard's Run took to return after its ctx ended
}

// emit hands s to fn, if there is one. fn runs on coord's goroutines: it
// must be quick and must not call back into what sent the signal.
func emit(fn func(Signal), s Signal) {
	if fn != nil {
		fn(s)
	}
}
