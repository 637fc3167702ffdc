// odyssey traj ls | show | export | verify
#include "cli/commands.h"

namespace odyssey::cli {
void add_traj_commands(CLI::App&, Action&) {}
}  // namespace odyssey::cli
