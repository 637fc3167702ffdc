# Trajectories: the token-native record of what a policy did in an environment.
# The same bytes travel over ZeroMQ and are stored as RocksDB values (replay/store.h).
# Evolution rules: core/schema/README.md. Never renumber, retype or remove a field.
@0xc35a332f79953427;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("odyssey::schema");

# A piece of a trajectory: up to a few thousand tokens or one turn. A trajectory of a
# million tokens is a few hundred of these, streamed while it is generated.
#
# Integrity: `hashLo`/`hashHi` MUST stay ordinals @0/@1 (data words 0 and 1 of the root
# struct). The segment hash is XXH3-128 over the message's flat bytes (single segment,
# with its segment table) with those 16 bytes read as zero. `prevHash` is the hash of the
# segment before (zero for seq 0), so segments form a chain ending in the trajectory
# record's `lastHash`. Any byte flipped anywhere in a stored value breaks its hash.
struct Segment {
  hashLo @0 :UInt64;
  hashHi @1 :UInt64;
  trajectoryId @2 :UInt64;
  seq @3 :UInt32;                  # 0, 1, 2, ... within the trajectory
  prevHashLo @4 :UInt64;
  prevHashHi @5 :UInt64;
  tokenStart @6 :UInt64;           # position of tokens[0] in the whole trajectory

  # Per token, all the same length as `tokens`.
  tokens @7 :List(UInt32);
  logprobs @8 :List(Float32);      # sampling log-prob of the token (0 for non-model tokens)
  policyVersions @9 :List(UInt32); # policy version that produced the token
  lossMask @10 :Data;              # 1 = model token (trained on), 0 = prompt/tool/env token

  turns @11 :List(Turn);
  toolCalls @12 :List(ToolCall);
  images @13 :List(Image);
  routedExperts @14 :RoutedExperts;        # optional: null when not recorded
  stateSnapshots @15 :List(StateSnapshot); # optional recurrent-state snapshots
  createdUnixNanos @16 :Int64;
}

enum Role {
  system @0;
  user @1;
  assistant @2;
  tool @3;
}

# A turn (or the part of it inside this segment) as a token range of this segment.
struct Turn {
  role @0 :Role;
  start @1 :UInt32;                # offset into this segment's tokens
  length @2 :UInt32;
  continued @3 :Bool;              # the turn began in an earlier segment
}

enum ToolStatus {
  ok @0;
  toolError @1;                    # the tool ran and reported an error
  malformedCall @2;                # the model's call was not valid JSON
  unknownTool @3;
  badArguments @4;                 # arguments did not match the tool's schema
  timeout @5;
  crashed @6;                      # the plugin or its host died
}

struct ToolCall {
  callId @0 :Text;
  name @1 :Text;
  arguments @2 :Text;              # exactly what the model produced (may be invalid JSON)
  result @3 :Data;                 # what the environment returned (text as UTF-8)
  status @4 :ToolStatus;
  error @5 :Text;
  wallTimeNanos @6 :Int64;
  callTokenStart @7 :UInt32;       # offset of the call in this segment's tokens
  resultTokenStart @8 :UInt32;     # offset of the observation tokens
}

struct Image {
  tokenOffset @0 :UInt32;          # offset of the begin-image token in this segment
  numPatchTokens @1 :UInt32;
  mediaType @2 :Text;              # e.g. "image/png"
  width @3 :UInt32;
  height @4 :UInt32;
  data @5 :Data;                   # encoded bytes
}

struct RoutedExperts {
  numLayers @0 :UInt16;            # MoE layers recorded
  topK @1 :UInt16;
  experts @2 :List(UInt16);        # [token][layer][k], flattened
}

struct StateSnapshot {
  tokenPosition @0 :UInt64;        # absolute position the state was taken after
  policyVersion @1 :UInt32;
  format @2 :Text;                 # producer-defined, e.g. "odyssey.model.state/1"
  data @3 :Data;
}

enum TrajectoryStatus {
  inFlight @0;                     # segments still arriving
  complete @1;                     # ended with rewards, ready to sample
  consumed @2;                     # delivered to (and committed by) the learner
  withheld @3;                     # over the policy-lag bound: kept, auditable, not sampled
  failed @4;                       # ended by its writer as failed
}

struct RewardPart {
  name @0 :Text;
  value @1 :Float64;
}

struct Environment {
  name @0 :Text;
  version @1 :Text;
  pluginHash @2 :Text;
}

# One per trajectory; rewritten by the replay service as the trajectory progresses.
# `hashLo`/`hashHi`: the record's own XXH3-128, same rule as Segment.
struct Trajectory {
  hashLo @0 :UInt64;
  hashHi @1 :UInt64;
  id @2 :UInt64;
  job @3 :Text;
  environment @4 :Environment;
  task @5 :Text;
  seed @6 :UInt64;
  groupId @7 :UInt64;              # trajectories of one task sampled together (GRPO)
  groupSize @8 :UInt32;            # 0 or 1: not part of a group
  tokenizer @9 :Text;              # how to turn tokens into text (core/tokenizer.h)
  writer @10 :Text;                # who wrote it (actor name)

  status @11 :TrajectoryStatus;
  rewardTotal @12 :Float64;
  rewardParts @13 :List(RewardPart);
  error @14 :Text;                 # why it failed or was withheld

  numSegments @15 :UInt32;
  numTokens @16 :UInt64;
  numBytes @17 :UInt64;            # bytes of its stored segments
  lastHashLo @18 :UInt64;
  lastHashHi @19 :UInt64;
  minPolicyVersion @20 :UInt32;
  maxPolicyVersion @21 :UInt32;

  startedUnixNanos @22 :Int64;
  endedUnixNanos @23 :Int64;
  readySeq @24 :UInt64;            # order in which it became sampleable (1-based; 0 = not yet)
  timesSampled @25 :UInt32;
  priority @26 :Float64;
}
