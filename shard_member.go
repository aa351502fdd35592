package coord

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The members of a shard set and how they rank: each ShardSet announces
// itself under its Prefix, and ranks only the members that are live hosts.

// ShardMemberSegment is the key segment under a shard set's Prefix where
// its members announce themselves, one key each:
// Prefix+"@members/"+HostUUID, on the member's lease, its value the JSON
// of its ShardMember. No shard name starts with "@", so that no member key
// is ever taken for a shard's candidate. Wire format.
const ShardMemberSegment = "@members"

// ShardMember is a member of a shard set, as its member key says: a host
// that runs a ShardSet on the same Prefix. Its JSON is the member key's
// value, wire format shared by every member.
type ShardMember struct {
	HostUUID string  `json:"host_uuid"`
	Weight   float64 `json:"weight"`             // capacity relative to the other members
	Zone     string  `json:"zone,omitempty"`     // failure domain
	Draining bool    `json:"draining,omitempty"` // handing its shards over, taking none
}

// memberKey returns the key of host's member announcement under prefix.
func memberKey(prefix, host string) string { return prefix + ShardMemberSegment + "/" + host }

// decodeMember reads a member key; ok is false for a key or value that is
// not a member's.
func decodeMember(prefix string, kv *mvccpb.KeyValue) (m ShardMember, ok bool) {
	host := strings.TrimPrefix(string(kv.Key), prefix+ShardMemberSegment+"/")
	if err := json.Unmarshal(kv.Value, &m); err != nil || m.HostUUID != host || !(m.Weight > 0) || math.IsInf(m.Weight, 0) {
		return ShardMember{}, false
	}
	return m, true
}

// rankedMember is a member as a shard ranks it: with its rendezvous
// weight and score for the shard, computed once. It points to the member,
// which every shard's ranking shares: a fleet's rankings are shards ×
// members of these, kept small.
type rankedMember struct {
	*ShardMember
	w     uint64  // weight(shard, HostUUID)
	score float64 // see score
}

// rankOn returns m as shard ranks it.
func rankOn(shard string, m *ShardMember) rankedMember {
	w := weight(shard, m.HostUUID)
	return rankedMember{m, w, score(m.Weight, w)}
}

// member returns m: what pickRanked picks from.
func (m ShardMember) member() ShardMember { return m }

// score is the weighted rendezvous score of a member of weight weight
// whose rendezvous weight is w: −weight/ln(h), h being w mapped into
// (0, 1). A member of weight 2 scores highest about twice as often as one
// of weight 1.
func score(weight float64, w uint64) float64 {
	h := (float64(w>>11) + 0.5) / (1 << 53)
	return -weight / math.Log(h)
}

// before reports whether a ranks before b for their shard: draining
// members last; then by weighted score, the highest first; then as
// RankHosts ranks (which is the order of the scores when the weights are
// equal, without their rounding).
func (a rankedMember) before(b rankedMember) bool {
	if a.Draining != b.Draining {
		return b.Draining
	}
	if a.Weight != b.Weight && a.score != b.score {
		return a.score > b.score
	}
	return heavier(a.w, a.HostUUID, b.w, b.HostUUID)
}

// byRank orders members of one shard, best first; no two are equal (they
// are distinct hosts).
func byRank(a, b rankedMember) int {
	if a.before(b) {
		return -1
	}
	return 1
}

// memberBefore reports whether member a ranks before member b for shard.
func memberBefore(shard string, a, b ShardMember) bool {
	return rankOn(shard, &a).before(rankOn(shard, &b))
}

// RankMembers returns members in the order every ShardSet ranks them for
// shard, best first: draining members last; then by weighted rendezvous
// score, the highest first; then as RankHosts ranks (for members of one
// weight that do not drain, the order of RankHosts). A candidate in line
// behind a shard's owner that ranks before it is a planned move: the
// owner hands the shard over. members is not changed.
//
// Like RankHosts, the ranking is wire format: it must never change.
func RankMembers(shard string, members []ShardMember) []ShardMember {
	ranked := make([]rankedMember, len(members))
	for i, m := range members {
		ranked[i] = rankOn(shard, &m)
	}
	slices.SortFunc(ranked, byRank)
	out := make([]ShardMember, len(ranked))
	for i, m := range ranked {
		out[i] = *m.ShardMember
	}
	return out
}

// pickRanked returns the candidates among ranked, best first: the
// best-ranked member of each zone, in rank order, until there are n; then
// the best-ranked others. So a shard's n candidates are in n zones while
// there are that many.
func pickRanked[M interface{ member() ShardMember }](ranked []M, n int) []M {
	out := make([]M, 0, n)
	zones := map[string]bool{}
	var rest []M
	for _, m := range ranked {
		if z := m.member().Zone; len(out) < n && !zones[z] {
			zones[z] = true
			out = append(out, m)
		} else if len(rest) < n {
			rest = append(rest, m)
		}
	}
	return append(out, rest[:min(len(rest), n-len(out))]...)
}

// memberLocked returns host's member record, and whether it is a live
// member: its member key is there and its host is live.
func (s *ShardSet) memberLocked(host string) (ShardMember, bool) {
	m, ok := s.members[host]
	return m, ok && s.hosts[host]
}

// selfLocked returns our member record as the others rank us.
func (s *ShardSet) selfLocked() ShardMember {
	return ShardMember{HostUUID: s.opts.Self, Weight: s.opts.Weight, Zone: s.opts.Zone, Draining: s.draining}
}

// rankedLocked reports whether we are among shard's candidates, as its
// ranking says: the first Replicas, while the members are in one zone.
func (s *ShardSet) rankedLocked(shard string) bool {
	picked := s.order[shard]
	if s.zoned {
		picked = pickRanked(picked, s.opts.Replicas)
	}
	return slices.ContainsFunc(picked[:min(len(picked), s.opts.Replicas)], func(m rankedMember) bool { return m.HostUUID == s.opts.Self })
}

// reorderLocked brings every shard's ranking in line with the live
// members that take part (not draining; for us, what we are now), and
// reports whether any changed. A member that changed is taken out of each
// ranking and put back in its place: a binary search per shard, or one
// sort of each ranking when several join at once (a listing).
func (s *ShardSet) reorderLocked() bool {
	now := map[string]ShardMember{}
	zones := map[string]bool{}
	for h, m := range s.members {
		if h == s.opts.Self {
			m = s.selfLocked()
		}
		if s.hosts[h] && !m.Draining {
			now[h] = m
			zones[m.Zone] = true
		}
	}
	s.zoned = len(zones) > 1
	changed := false
	for h, old := range s.ordered {
		if m, ok := now[h]; !ok || m != old {
			for shard, o := range s.order {
				s.order[shard] = slices.DeleteFunc(o, func(m rankedMember) bool { return m.HostUUID == h })
			}
			delete(s.ordered, h)
			changed = true
		}
	}
	var joined []*ShardMember
	for h, m := range now {
		if _, ok := s.ordered[h]; !ok {
			joined = append(joined, &m)
			s.ordered[h] = m
		}
	}
	if len(joined) == 0 {
		return changed
	}
	for shard := range s.cands {
		o := s.order[shard]
		if len(joined) == 1 {
			m := rankOn(shard, joined[0])
			i, _ := slices.BinarySearchFunc(o, m, byRank)
			s.order[shard] = slices.Insert(o, i, m)
			continue
		}
		o = slices.Grow(o, len(joined))
		for _, m := range joined {
			o = append(o, rankOn(shard, m))
		}
		slices.SortFunc(o, byRank)
		s.order[shard] = o
	}
	s.joined = time.Now()
	return true
}

// Members returns the live members of the shard set as we see them (us
// included, once our announcement is seen), sorted by HostUUID. It never
// talks to etcd.
func (s *ShardSet) Members() []ShardMember {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []ShardMember
	for h := range s.members {
		if m, live := s.memberLocked(h); live {
			out = append(out, m)
		}
	}
	slices.SortFunc(out, func(a, b ShardMember) int { return cmp.Compare(a.HostUUID, b.HostUUID) })
	return out
}

// announce puts our member key on sess's lease, with what we are now,
// within ctx and the TTL.
func (s *ShardSet) announce(ctx context.Context, sess *session) error {
	s.mu.Lock()
	m := s.selfLocked()
	s.mu.Unlock()
	val, _ := json.Marshal(m) // a struct of plain fields: never fails
	ctx, cancel := withCancelOn(ctx, sess.ctx)
	defer cancel()
	ctx, cancelT := context.WithTimeout(ctx, sess.ttl)
	defer cancelT()
	since := s.viewMark.at()
	resp, err := s.cli.Put(ctx, memberKey(s.opts.Prefix, s.opts.Self), string(val), clientv3.WithLease(sess.id))
	if err != nil {
		return fmt.Errorf("announce member: %w", err)
	}
	s.heard(resp.Header, since)
	return nil
}

// announced records that our member key stands on sess, or, with nil,
// that we announce it again (see health).
func (s *ShardSet) announced(sess *session) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case sess != nil:
		s.member, s.announcing = sess, time.Time{}
	default:
		s.announcing = time.Now()
	}
}

// keepAnnounced keeps our member key, on a session of its own, for as long
// as the shard set lives: a session that ends is replaced, and the key put
// again; so is a key deleted by someone else, or ours while draining
// changes. sess is the first session, announced already.
func (s *ShardSet) keepAnnounced(sess *session) {
	defer s.wg.Done()
	var r retry
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-sess.ctx.Done():
		case <-s.reannounce:
			if s.announce(s.ctx, sess) == nil {
				continue
			}
			sess.end(errAnnounceFailed)
		}
		s.log.Info("coord: shard set: member session ended, announcing again", "err", sess.Err())
		s.announced(nil)
		for s.ctx.Err() == nil {
			next, err := startSession(s.ctx, s.ctx, s.cli, s.opts.TTL, s.log, &s.leases)
			if err == nil {
				if err = s.announce(s.ctx, next); err == nil {
					sess = next
					s.announced(sess)
					break
				}
				next.end(errAnnounceFailed)
			}
			s.log.Warn("coord: shard set: cannot announce member, retrying", "err", err)
			sleep(s.ctx, r.next())
		}
		r = retry{}
	}
}
