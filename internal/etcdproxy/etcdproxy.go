// Package etcdproxy serves etcd's gRPC proxy in this process: the services
// `etcd grpc-proxy start` serves, built as it builds them, from
// go.etcd.io/etcd/server/v3/proxy/grpcproxy. coordtest runs it in front of
// an embedded etcd, and the bench in a child process of its own.
package etcdproxy

import (
	"math"
	"net"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3election/v3electionpb"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3lock/v3lockpb"
	"go.etcd.io/etcd/server/v3/proxy/grpcproxy"
	"go.uber.org/zap"
	"google.golang.org/grpc"
)

// Server is a running proxy.
type Server struct {
	cli    *clientv3.Client // the proxy's client of etcd
	srv    *grpc.Server
	served chan struct{} // closed once Serve has returned
	// The ends of the watch and lease proxies: closed once every stream
	// they served is through, after cli is closed.
	ends []<-chan struct{}
}

// Serve serves the proxy on ln, in front of the etcd that cfg reaches;
// advertise is the address its member list answers. It takes ln: it is
// closed if Serve fails.
func Serve(ln net.Listener, cfg clientv3.Config, advertise string) (*Server, error) {
	// As the binary's client: these take the place of the client's own
	// (retrying) interceptors, so that a request is tried once, by its
	// client, through the proxy.
	cfg.DialOptions = append(cfg.DialOptions,
		grpc.WithUnaryInterceptor(grpcproxy.AuthUnaryClientInterceptor),
		grpc.WithStreamInterceptor(grpcproxy.AuthStreamClientInterceptor))
	cli, err := clientv3.New(cfg)
	if err != nil {
		_ = ln.Close()
		return nil, err
	}
	lg := zap.NewNop()
	kv, _ := grpcproxy.NewKvProxy(cli)
	watch, watchEnd := grpcproxy.NewWatchProxy(cli.Ctx(), lg, cli)
	cluster, _ := grpcproxy.NewClusterProxy(lg, cli, advertise, "")
	lease, leaseEnd := grpcproxy.NewLeaseProxy(cli.Ctx(), cli)
	srv := grpc.NewServer(grpc.MaxConcurrentStreams(math.MaxUint32), grpc.WaitForHandlers(true))
	pb.RegisterKVServer(srv, kv)
	pb.RegisterWatchServer(srv, watch)
	pb.RegisterClusterServer(srv, cluster)
	pb.RegisterLeaseServer(srv, lease)
	pb.RegisterMaintenanceServer(srv, grpcproxy.NewMaintenanceProxy(cli))
	pb.RegisterAuthServer(srv, grpcproxy.NewAuthProxy(cli))
	v3electionpb.RegisterElectionServer(srv, grpcproxy.NewElectionProxy(cli))
	v3lockpb.RegisterLockServer(srv, grpcproxy.NewLockProxy(cli))
	s := &Server{cli: cli, srv: srv, served: make(chan struct{}), ends: []<-chan struct{}{watchEnd, leaseEnd}}
	go func() {
		defer close(s.served)
		_ = srv.Serve(ln) // ends at Stop
	}()
	return s, nil
}

// Served is closed once the server has stopped serving.
func (s *Server) Served() <-chan struct{} { return s.served }

// Stop closes the server's listener and connections, its in-flight RPCs
// cancelled (as a crash leaves them), then the proxy's client of etcd, and
// waits up to timeout for the proxies' goroutines. It reports whether
// they all ended.
func (s *Server) Stop(timeout time.Duration) bool {
	s.srv.Stop() // returns once every handler has (WaitForHandlers)
	<-s.served
	_ = s.cli.Close()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for _, end := range s.ends {
		select {
		case <-end:
		case <-deadline.C:
			return false
		}
	}
	return true
}
