#pragma once
// `tdshm gc` for boards: the files /dev/shm/tdshm-board.<name> whose writer's process is gone and
// that no live reader has open. A reader that goes last removes such a board itself; what is left
// is the board of a writer killed with no reader, or whose readers were killed too. Anything gc
// cannot prove stale is kept and reported: another uid's file, a link, a file open to group or
// other, a file that is no board of this layout. A name is removed only under the board file's
// lock and while it still names the file checked (board_state.h, open_locked), so a board a new
// writer made meanwhile is never removed.

#include <string>
#include <vector>

namespace tdshm::detail {

struct BoardGcItem {
  std::string name;  // the board's name (the part after "tdshm-board.")
  bool removable = false;
  std::string reason;  // why removable, or why kept
  bool removed = false;
  std::string error;  // a removal that failed unexpectedly
};

/// Every board file in /dev/shm (only those of `names` when given), decided, and unless a dry run
/// the stale ones removed.
std::vector<BoardGcItem> collect_stale_boards(bool dry_run, const std::vector<std::string>& names = {});

}  // namespace tdshm::detail
