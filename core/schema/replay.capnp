# The replay service's wire protocol (ZeroMQ DEALER -> ROUTER). A request is one frame
# holding a Request message; appendSegment adds a second frame with the Segment
# message's flat bytes, stored verbatim. Every request gets exactly one Response with
# the same id. Evolution rules: core/schema/README.md.
@0xa23f8ed04a76402f;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("odyssey::schema");

using T = import "trajectory.capnp";

const protocolVersion :UInt32 = 1;

struct Request {
  id @0 :UInt64;                    # echoed in the response
  union {
    hello @1 :Hello;
    begin @2 :T.Trajectory;         # identity fields only; the service owns the rest
    append @3 :Append;
    end @4 :End;
    sample @5 :Sample;
    read @6 :Read;
    commit @7 :Commit;
    resume @8 :Resume;
    updatePriorities @9 :List(Priority);
    setPolicyVersion @10 :UInt32;
    checkpoint @11 :Text;           # directory to create
    stats @12 :Void;
  }
}

struct Hello {
  client @0 :Text;
  protocolVersion @1 :UInt32;
}

struct Append {
  trajectoryId @0 :UInt64;
  seq @1 :UInt32;                   # must match the Segment in the next frame
}

struct End {
  trajectoryId @0 :UInt64;
  numSegments @1 :UInt32;
  lastHashLo @2 :UInt64;
  lastHashHi @3 :UInt64;
  failed @4 :Bool;
  error @5 :Text;
  rewardTotal @6 :Float64;
  rewardParts @7 :List(T.RewardPart);
}

struct Sample {
  count @0 :UInt32;                 # trajectories (or whole groups, for group-complete)
  timeoutMillis @1 :UInt32;         # wait this long for the rate limiter / enough data
}

struct Read {
  trajectoryId @0 :UInt64;
  fromSeq @1 :UInt32;
  maxSegments @2 :UInt32;
  maxBytes @3 :UInt64;
}

struct Commit {
  cursor @0 :UInt64;                # commit every delivery up to and including this one
}

struct Resume {
  cursor @0 :UInt64;                # the cursor of the consumer's last checkpoint
}

struct Priority {
  trajectoryId @0 :UInt64;
  priority @1 :Float64;
}

enum ErrorCode {
  none @0;
  badRequest @1;                    # malformed or inconsistent message
  tooLarge @2;
  unknownTrajectory @3;
  conflict @4;                      # same key, different content (or out of order)
  rateLimited @5;                   # timed out waiting on the rate limiter
  storage @6;
  corrupt @7;                       # stored data failed its integrity check
  unsupported @8;
}

struct Response {
  id @0 :UInt64;
  error @1 :ErrorCode;
  message @2 :Text;                 # human-readable, says what to do
  union {
    ack @3 :Void;
    hello @4 :HelloReply;
    sample @5 :SampleReply;
    read @6 :ReadReply;             # segments follow as extra frames
    stats @7 :Stats;
  }
}

struct HelloReply {
  protocolVersion @0 :UInt32;
  maxMessageBytes @1 :UInt64;
  credits @2 :UInt32;               # unacknowledged segments a writer may have in flight
  server @3 :Text;
}

struct SampleReply {
  items @0 :List(T.Trajectory);
  cursor @1 :UInt64;                # pass to commit() once trained on (0: nothing to commit)
  groupBoundaries @2 :List(UInt32); # group-complete: start index of each group in items
}

struct ReadReply {
  numSegments @0 :UInt32;           # segment frames that follow
  endOfTrajectory @1 :Bool;
}

struct Stats {
  trajectories @0 :UInt64;
  inFlight @1 :UInt64;
  complete @2 :UInt64;
  consumed @3 :UInt64;
  withheld @4 :UInt64;
  failed @5 :UInt64;
  segments @6 :UInt64;
  bytes @7 :UInt64;
  inserts @8 :UInt64;               # rate limiter counters
  samples @9 :UInt64;
  policyVersion @10 :UInt32;
  sampler @11 :Text;
  segmentsWritten @12 :UInt64;      # since start: new segments made durable
  duplicatesIgnored @13 :UInt64;
  commitsSynced @14 :UInt64;        # durable write batches (group commits)
}
