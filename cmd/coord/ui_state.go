package main

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-coord/coord"
	"go.etcd.io/etcd/api/v3/mvccpb"
)

// uiView is the fleet as coord ui shows it, at one version of its state:
// what the page renders, what /state and each event of /events carry.
// Times and TTLs come formatted, so that the page's first HTML and its
// script show the same text.
type uiView struct {
	Version    uint64          `json:"version"`
	Hosts      []uiHost        `json:"hosts"` // the down ones first, then by HostUUID
	Live       int             `json:"live"`  // how many hosts are live
	Down       int             `json:"down"`  // and down
	Elections  []uiElection    `json:"elections"`
	Shards     uiShards        `json:"shards"`
	Semaphores []semaphoreInfo `json:"semaphores"`
	// Problems are what cannot be read now, by part ("hosts", "leases",
	// "elections", "shards", "semaphores"): that part shows what was read
	// last.
	Problems []string `json:"problems"`
	// Etcd says when etcd last answered, or since when it has not: Stale
	// is then set, and every value is as read last.
	Etcd  string `json:"etcd"`
	Stale bool   `json:"stale"`
	// Warnings are what an operator should look at: a shard without a
	// standby, a member owning far more than its weight's share. (A shard
	// nobody campaigns for has no key: the page cannot know of it.)
	Warnings []string `json:"warnings"`
	// Names are the hostnames of the hosts known, by HostUUID: the page
	// shows a host by its name wherever it appears (its UUID on hover).
	Names map[string]string `json:"names"`
}

// Name returns the hostname of the host whose UUID is id, id if none is
// known (an identity that is no host's UUID).
func (v uiView) Name(id string) string {
	if n := v.Names[id]; n != "" {
		return n
	}
	return id
}

// Cand shows a shard candidate by its host's name, with its zone, a weight
// other than 1 and a drain, if its member key says so.
func (v uiView) Cand(c shardCandidate) string {
	c.Hostname = ""
	s := c.String()
	return v.Name(c.Identity) + strings.TrimPrefix(s, c.Identity)
}

// uiHost is a host of the view: live, or down (kept, shown red, until it
// comes back or uiDownKept more hosts have gone down since).
type uiHost struct {
	coord.HostMetadata
	Down    bool   `json:"down"`
	UpSince string `json:"up_since"` // its StartedAt, else when ui saw it up
	DownAt  string `json:"down_at,omitempty"`
	// DownHow says how a down host went, where the page can know it (see
	// uiHostState.notBefore): "stopped", its lease revoked (a clean Stop)
	// or its key deleted before the lease could expire, or "lease
	// expired", no renewal in its TTL (a crash, a hang or a lost link).
	DownHow string `json:"down_how,omitempty"`
	TTL     string `json:"ttl"` // the lease's time left, "" until read
	// Late is set when the lease's time left says a renewal is overdue
	// (see renewalLate): the host may be about to step down, or go.
	Late   bool   `json:"late,omitempty"`
	Labels string `json:"labels_text"`
	// Roles is what the host leads, owns and holds: the elections and
	// permits whose identity is its UUID or its hostname, and the shards
	// it owns.
	Roles string `json:"roles"`
}

// uiElection is an election under --elections: its leader and the
// candidates in line behind it.
type uiElection struct {
	Key    string       `json:"key"`
	Leader permitInfo   `json:"leader"`
	Queue  []permitInfo `json:"queue"`
	// Since is when the page saw the leader take over, or "before" the
	// time the page started if it led then.
	Since string `json:"since"`
}

// uiShards is the shard set under --shards.
type uiShards struct {
	Prefix  string     `json:"prefix"`
	Members []uiMember `json:"members"` // by HostUUID
	Shards  []uiShard  `json:"shards"`  // by name
	Moving  int        `json:"moving"`  // shards with a move in flight
}

// uiMember is a member announcement of the shard set.
type uiMember struct {
	coord.ShardMember
	Live bool `json:"live"` // its host is live
	// State is "down" (its host is), "leaving" (drained: it owns nothing
	// and takes nothing), "draining" (handing its shards over),
	// "joining" (it owns nothing yet, shards are moving to it) or
	// "active".
	State string `json:"state"`
	TTL   string `json:"ttl"` // its host's lease time left, as uiHost's
	Late  bool   `json:"late,omitempty"`
	Owns  int    `json:"owns"`
	Share string `json:"share"` // of the shards it owns, and its weight's share: "25% of 4 (weight: 50%)"
}

// uiShard is a shard: its owner and standbys, and whether it is moving.
type uiShard struct {
	shardInfo
	// Moving is why the shard is about to change owner, "" if it is not:
	// a standby in line ranks before the owner (a planned move: the
	// owner hands over once its Run returns), or the owner's host is
	// down (a failover: its standby takes over once its lease expires).
	Moving string `json:"moving,omitempty"`
}

// uiDownKept is how many down hosts the view keeps.
const uiDownKept = 64

// uiState is the state the followers of coord ui keep and its pages
// read. Each change makes a new version and wakes the readers waiting on
// changed. It is safe for concurrent use.
type uiState struct {
	shardsPrefix string

	mu        sync.Mutex
	version   uint64
	changed   chan struct{} // closed and replaced at each change
	hosts     map[string]*uiHostState
	downs     []string // down hosts, oldest first
	elections []uiElection
	shards    []shardInfo
	members   map[string]coord.ShardMember
	sems      []semaphoreInfo
	problems  map[string]string
	heard     time.Time     // when etcd last answered the probe
	unheard   time.Time     // since when it has not, zero while it answers
	relist    chan struct{} // closed and replaced when etcd is found replaced
	swapped   string        // when and how it last was, "" if never
	started   time.Time     // when the elections were first listed
	// leaders are the leaders seen, by election key, with the time the
	// page saw each take over (zero: it led when the page started).
	leaders map[string]uiLeader
}

// uiLeader is an election's leader as the page saw it take over.
type uiLeader struct {
	token int64
	lease string
	since time.Time
}

// uiHostState is what the state knows of a host.
type uiHostState struct {
	meta    coord.HostMetadata
	up      time.Time
	downAt  time.Time // zero while live
	downHow string    // see uiHost.DownHow
	ttl     string
	late    bool
	// notBefore is the earliest time the host's lease can expire, as its
	// time left was last read: etcd gives the time left in whole seconds,
	// rounded down, and a renewal or an etcd leader change only puts the
	// expiry later. A Down seen before it is not an expiry: the lease was
	// revoked or the key deleted. Zero until a read sent after the host
	// came up (an earlier one may be of its previous lease).
	notBefore time.Time
}

func newUIState(shardsPrefix string) *uiState {
	return &uiState{shardsPrefix: shardsPrefix, changed: make(chan struct{}), relist: make(chan struct{}),
		hosts: map[string]*uiHostState{}, members: map[string]coord.ShardMember{}, problems: map[string]string{},
		leaders: map[string]uiLeader{}}
}

// update applies f under the lock and publishes a new version.
func (s *uiState) update(f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f()
	s.version++
	close(s.changed)
	s.changed = make(chan struct{})
}

// problem records what cannot be read of part now; err nil clears it.
func (s *uiState) problem(part string, err error) {
	s.mu.Lock()
	old, had := s.problems[part]
	s.mu.Unlock()
	if err == nil && !had || err != nil && had && old == err.Error() {
		return
	}
	s.update(func() {
		if err == nil {
			delete(s.problems, part)
		} else {
			s.problems[part] = err.Error()
		}
	})
}

// answered records whether etcd answered a probe made at now (see
// probeEtcd). The view changes when etcd stops or starts answering, and
// at most once a second meanwhile: its times are to the second.
func (s *uiState) answered(ok bool, now time.Time) {
	s.mu.Lock()
	same := ok && s.unheard.IsZero() && s.heard.Truncate(time.Second).Equal(now.Truncate(time.Second))
	if same {
		s.heard = now
	}
	s.mu.Unlock()
	if same {
		return
	}
	s.update(func() {
		if ok {
			s.heard, s.unheard = now, time.Time{}
		} else if s.unheard.IsZero() {
			s.unheard = now
		}
	})
}

// replaced records that etcd was found replaced at now (how says why), and
// has every part listed again: the followers' watches end (see
// relisting), the host watcher lists by itself.
func (s *uiState) replaced(how string, now time.Time) {
	s.update(func() {
		s.swapped = "etcd replaced or restored at " + now.Format(time.TimeOnly) + " (" + how + "): everything listed again"
		close(s.relist)
		s.relist = make(chan struct{})
	})
}

// relisting returns a channel closed when etcd is found replaced.
func (s *uiState) relisting() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.relist
}

// noteHost applies a host event, seen at now.
func (s *uiState) noteHost(ev coord.HostEvent, now time.Time) {
	s.update(func() {
		h := s.hosts[ev.HostUUID]
		switch {
		case ev.Kind == coord.HostDown && h != nil:
			h.meta, h.downAt, h.ttl, h.downHow = ev.Metadata, now, "", downHow(h, ev, now)
			s.downs = append(s.downs, ev.HostUUID)
			if len(s.downs) > uiDownKept {
				if old := s.hosts[s.downs[0]]; old != nil && !old.downAt.IsZero() {
					delete(s.hosts, s.downs[0])
				}
				s.downs = s.downs[1:]
			}
		case ev.Kind == coord.HostDown:
		case h == nil || !h.downAt.IsZero():
			s.hosts[ev.HostUUID] = &uiHostState{meta: ev.Metadata, up: now}
		default:
			h.meta = ev.Metadata
		}
	})
}

// downHow says how host h went at now, as ev tells it (see
// uiHost.DownHow): "" where the page cannot know, as for a Down that a
// listing found (the watcher's resync, after a compaction or with a new
// etcd) rather than a watch event.
func downHow(h *uiHostState, ev coord.HostEvent, now time.Time) string {
	switch {
	case ev.Synthetic || h.notBefore.IsZero():
		return ""
	case now.Before(h.notBefore):
		return "stopped"
	}
	return "lease expired"
}

// renewalLate reports whether h's lease has less time left than a
// renewal on time leaves it, by more than etcd's rounding: coord renews a
// third of the TTL after each answered renewal, so a lease it keeps has
// two thirds of its TTL left or more; at a third or less, its holder
// steps down.
func renewalLate(h liveHost) bool {
	return h.TTLLeft >= 0 && float64(h.TTLLeft)+1 < 2*float64(h.GrantedTTL)/3
}

// noteTTLs applies the leases' time left read from etcd (listHosts), in
// a read sent at sent, to the live hosts the watcher has shown: a host
// the listing misses, or only it has, waits for the watcher's event.
func (s *uiState) noteTTLs(hosts []liveHost, sent time.Time) {
	read := map[string]liveHost{}
	for _, h := range hosts {
		read[h.HostUUID] = h
	}
	s.mu.Lock()
	same := true
	for id, h := range s.hosts {
		r, ok := read[id]
		if !ok || !h.downAt.IsZero() {
			continue
		}
		if h.ttl != formatTTL(r) || h.late != renewalLate(r) {
			same = false
		}
		// Only a read sent after the host came up is of its lease.
		if sent.After(h.up) {
			if b := sent.Add(time.Duration(max(r.TTLLeft, 0)) * time.Second); b.After(h.notBefore) {
				h.notBefore = b
			}
		}
	}
	s.mu.Unlock()
	if same {
		return
	}
	s.update(func() {
		for id, h := range s.hosts {
			if r, ok := read[id]; ok && h.downAt.IsZero() {
				h.ttl, h.late = formatTTL(r), renewalLate(r)
			}
		}
	})
}

// view returns the current view, and a channel closed at the next change.
func (s *uiState) view() (uiView, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := uiView{Version: s.version, Hosts: []uiHost{}, Elections: s.elections, Semaphores: s.sems, Problems: []string{},
		Names: map[string]string{}, Warnings: []string{}}
	for _, id := range slices.Sorted(maps.Keys(s.hosts)) {
		h := s.hosts[id]
		up := h.up
		if h.meta.StartedAt != 0 {
			up = time.Unix(0, h.meta.StartedAt)
		}
		uh := uiHost{HostMetadata: h.meta, UpSince: up.Format(time.DateTime), TTL: h.ttl, Late: h.late, Labels: formatLabels(h.meta.Labels)}
		if h.meta.Hostname != "" {
			v.Names[id] = h.meta.Hostname
		}
		if !h.downAt.IsZero() {
			uh.Down, uh.DownAt, uh.DownHow, uh.TTL = true, h.downAt.Format(timestamp), h.downHow, "down"
			v.Down++
		} else {
			v.Live++
		}
		v.Hosts = append(v.Hosts, uh)
	}
	// Down hosts first: they are what an operator looks for.
	slices.SortStableFunc(v.Hosts, func(a, b uiHost) int {
		switch {
		case a.Down == b.Down:
			return 0
		case a.Down:
			return -1
		}
		return 1
	})
	v.Shards, v.Warnings = s.shardsViewLocked()
	roles := s.rolesLocked(v.Shards.Shards)
	for i := range v.Hosts {
		v.Hosts[i].Roles = roles.of(s, v.Hosts[i].HostMetadata)
	}
	for _, part := range slices.Sorted(maps.Keys(s.problems)) {
		v.Problems = append(v.Problems, part+": "+s.problems[part])
	}
	v.Etcd = "etcd last answered at " + s.heard.Format(time.TimeOnly)
	if s.swapped != "" {
		v.Etcd += "; " + s.swapped
	}
	if !s.unheard.IsZero() {
		v.Stale = true
		v.Etcd = fmt.Sprintf("etcd unreachable since %s (%v): every value is as last read; %s",
			s.unheard.Format(time.TimeOnly), time.Since(s.unheard).Round(time.Second), v.Etcd)
	}
	return v, s.changed
}

// liveLocked reports whether host is live as the watcher shows it.
func (s *uiState) liveLocked(host string) bool {
	h := s.hosts[host]
	return h != nil && h.downAt.IsZero()
}

// shardsViewLocked is the shard set as the view shows it: each shard
// with its move in flight, if any, judged as the members judge it; and
// the warnings of what looks wrong (see uiView.Warnings).
func (s *uiState) shardsViewLocked() (uiShards, []string) {
	v := uiShards{Prefix: s.shardsPrefix, Members: []uiMember{}, Shards: []uiShard{}}
	warn := []string{}
	owns := map[string]int{}
	movingTo := map[string]bool{} // members a shard is moving to
	live := 0                     // members that take shards: live, not draining
	weights := 0.0
	for id, m := range s.members {
		if s.liveLocked(id) && !m.Draining {
			live++
			weights += m.Weight
		}
	}
	for _, sh := range s.shards {
		u := uiShard{shardInfo: sh}
		owns[sh.Owner.Identity]++
		if len(sh.Standbys) == 0 && live > 1 {
			warn = append(warn, fmt.Sprintf("shard %s has no standby", sh.Shard))
		}
		if !s.liveLocked(sh.Owner.Identity) {
			u.Moving = "failover: owner down"
		} else if by := s.outrankedLocked(sh); by != "" {
			movingTo[by] = true
			u.Moving = "to " + by
			if h := s.hosts[by]; h != nil && h.meta.Hostname != "" {
				u.Moving = "to " + h.meta.Hostname
			}
		}
		if u.Moving != "" {
			v.Moving++
		}
		v.Shards = append(v.Shards, u)
	}
	for _, id := range slices.Sorted(maps.Keys(s.members)) {
		m := uiMember{ShardMember: s.members[id], Live: s.liveLocked(id), Owns: owns[id]}
		if h := s.hosts[id]; m.Live {
			m.TTL, m.Late = h.ttl, h.late
		}
		switch {
		case !m.Live:
			m.State = "down"
		case m.Draining && m.Owns == 0:
			m.State = "leaving"
		case m.Draining:
			m.State = "draining"
		case m.Owns == 0 && movingTo[id]:
			m.State = "joining"
		default:
			m.State = "active"
		}
		if n := len(s.shards); n > 0 {
			share, fair := float64(m.Owns)/float64(n), 0.0
			if m.Live && !m.Draining && weights > 0 {
				fair = m.Weight / weights
			}
			m.Share = fmt.Sprintf("%.0f%% of %d (weight: %.0f%%)", 100*share, n, 100*fair)
			// Far more: half as much again as its weight's share, and
			// two shards at least (a share of a few shards is coarse).
			if float64(m.Owns) > 1.5*fair*float64(n) && float64(m.Owns)-fair*float64(n) >= 2 {
				warn = append(warn, fmt.Sprintf("%s owns %s", s.nameLocked(id), m.Share))
			}
		}
		v.Members = append(v.Members, m)
	}
	return v, warn
}

// uiRoles is what the elections, shards and semaphores say each identity
// leads, owns and holds: the indexes of the elections it leads and of the
// semaphores it holds a permit of, in their order, and how many shards it
// owns. Built in one pass over each, whatever the number of hosts.
type uiRoles struct {
	leads, holds map[string][]int
	owns         map[string]int
}

func (s *uiState) rolesLocked(shards []uiShard) uiRoles {
	r := uiRoles{leads: map[string][]int{}, holds: map[string][]int{}, owns: map[string]int{}}
	for i, e := range s.elections {
		r.leads[e.Leader.Identity] = append(r.leads[e.Leader.Identity], i)
	}
	for _, sh := range shards {
		r.owns[sh.Owner.Identity]++
	}
	for i, sem := range s.sems {
		seen := map[string]bool{}
		for _, p := range sem.Holders {
			if !seen[p.Identity] {
				seen[p.Identity] = true
				r.holds[p.Identity] = append(r.holds[p.Identity], i)
			}
		}
	}
	return r
}

// of says what the host of meta leads, owns and holds, by its UUID or its
// hostname (see uiHost.Roles), "" if nothing.
func (r uiRoles) of(s *uiState, meta coord.HostMetadata) string {
	ids := []string{meta.HostUUID}
	if meta.Hostname != "" && meta.Hostname != meta.HostUUID {
		ids = append(ids, meta.Hostname)
	}
	// in merges the indexes of both identities, in order.
	in := func(by map[string][]int) []int {
		var all []int
		for _, id := range ids {
			all = append(all, by[id]...)
		}
		slices.Sort(all)
		return slices.Compact(all)
	}
	var roles []string
	for _, i := range in(r.leads) {
		roles = append(roles, "leads "+s.elections[i].Key)
	}
	owns := 0
	for _, id := range ids {
		owns += r.owns[id]
	}
	switch {
	case owns == 1:
		roles = append(roles, "owns 1 shard")
	case owns > 1:
		roles = append(roles, fmt.Sprintf("owns %d shards", owns))
	}
	for _, i := range in(r.holds) {
		roles = append(roles, "holds a permit of "+s.sems[i].Key)
	}
	return strings.Join(roles, "; ")
}

// nameLocked returns the hostname of host, its UUID if none is known.
func (s *uiState) nameLocked(host string) string {
	if h := s.hosts[host]; h != nil && h.meta.Hostname != "" {
		return h.meta.Hostname
	}
	return host
}

// outrankedLocked returns the standby of sh that ranks before its owner,
// the best-ranked one, or "" if none does: the owner hands the shard to
// it. A candidate without a member record ranks as a ShardSet ranks one
// it has not seen yet: weight 1.
func (s *uiState) outrankedLocked(sh shardInfo) string {
	rankOf := func(c shardCandidate) coord.ShardMember {
		if m, ok := s.members[c.Identity]; ok {
			return m
		}
		return coord.ShardMember{HostUUID: c.Identity, Weight: 1}
	}
	line := []coord.ShardMember{rankOf(sh.Owner)}
	for _, c := range sh.Standbys {
		line = append(line, rankOf(c))
	}
	if best := coord.RankMembers(sh.Shard, line)[0]; best.HostUUID != sh.Owner.Identity {
		return best.HostUUID
	}
	return ""
}

// setElectionsLocked makes es, listed at now, the elections shown: each
// with the time its leader took over, as the page saw it.
func (s *uiState) setElectionsLocked(es []uiElection, now time.Time) {
	first := s.started.IsZero()
	if first {
		s.started = now
	}
	leaders := map[string]uiLeader{}
	for i, e := range es {
		l, ok := s.leaders[e.Key]
		if !ok || l.token != e.Leader.Token || l.lease != e.Leader.Lease {
			l = uiLeader{token: e.Leader.Token, lease: e.Leader.Lease, since: now}
			if first {
				l.since = time.Time{}
			}
		}
		leaders[e.Key] = l
		if l.since.IsZero() {
			es[i].Since = "before " + s.started.Format(time.TimeOnly)
		} else {
			es[i].Since = l.since.Format(timestamp)
		}
	}
	s.leaders, s.elections = leaders, es
}

// decodeElections reads the candidates of the elections under prefix:
// each key <prefix><name>/<lease> is a candidate of election
// <prefix><name> (name may hold slashes), in line by create revision.
func decodeElections(prefix string, kvs []*mvccpb.KeyValue) []uiElection {
	by := map[string][]*mvccpb.KeyValue{}
	for _, kv := range kvs {
		i := strings.LastIndexByte(string(kv.Key), '/')
		if i < len(prefix) || i == len(kv.Key)-1 {
			continue // <prefix><lease>, or a key ending in /: no election's
		}
		by[string(kv.Key[:i])] = append(by[string(kv.Key[:i])], kv)
	}
	out := []uiElection{}
	for _, key := range slices.Sorted(maps.Keys(by)) {
		kvs := by[key]
		slices.SortFunc(kvs, inLine)
		e := uiElection{Key: key, Queue: []permitInfo{}}
		for i, kv := range kvs {
			c := permitInfo{Identity: string(kv.Value), Token: kv.CreateRevision, Lease: fmt.Sprintf("%x", kv.Lease)}
			if i == 0 {
				e.Leader = c
			} else {
				e.Queue = append(e.Queue, c)
			}
		}
		out = append(out, e)
	}
	return out
}

// decodeSemaphores reads the semaphores under prefix from its keys, by
// create revision: a semaphore is a key without a lease that holds a
// limit (as NewSemaphore stores it), its permits the keys under it, read
// as coord semaphore reads them.
func decodeSemaphores(kvs []*mvccpb.KeyValue) []semaphoreInfo {
	out := []semaphoreInfo{}
	for _, kv := range kvs {
		if n, err := strconv.Atoi(string(kv.Value)); kv.Lease != 0 || err != nil || n < 1 {
			continue
		}
		key := string(kv.Key)
		var permits []*mvccpb.KeyValue
		for _, p := range kvs {
			if strings.HasPrefix(string(p.Key), key+"/") {
				permits = append(permits, p)
			}
		}
		if info, err := decodeSemaphore(key, []*mvccpb.KeyValue{kv}, permits); err == nil {
			out = append(out, info)
		}
	}
	slices.SortFunc(out, func(a, b semaphoreInfo) int { return strings.Compare(a.Key, b.Key) })
	return out
}
