// What the kernels that multiply on AMX tiles share (quant_gemm.cpp: the int4 and int8 paths;
// dense_tiles.cpp: dense bf16): the permission Linux gives a process to use the tiles, and the
// tile configuration's memory layout. BATCHLINE_AMX is defined where the library is built for a
// CPU with AMX-BF16 (-march=native).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BATCHLINE_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace batchline_quant {

// Linux hands out AMX's tile state to a process that asks for it (once; oneDNN asks too).
// Each thread configures the tiles for its own share of a call and releases them at its end,
// as oneDNN and ATen's brgemm users do, so that none of them finds another's configuration.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

// _tile_loadconfig's 64 bytes (palette 1): per tile register its rows and bytes a row.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace batchline_quant

#endif  // AMX
