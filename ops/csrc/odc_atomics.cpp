// Release/acquire accesses to the 64-bit control words ODC ranks exchange through shared memory.
//
// The step rendezvous publishes a round by writing its payload with plain stores and then its
// sequence word; a peer reads the sequence word and then the payload. On x86-64 (TSO) plain
// stores and loads already keep that order; on aarch64 and POWER they do not, so the sequence
// word is stored with release and loaded with acquire semantics here. Plain C functions, no torch
// headers: built by torch.utils.cpp_extension (ninja) in about a second and called through ctypes.
#include <cstdint>

extern "C" {

void odc_store_release_i64(int64_t* word, int64_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

int64_t odc_load_acquire_i64(const int64_t* word) {
    return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}

int64_t odc_fetch_add_i64(int64_t* word, int64_t delta) {
    return __atomic_fetch_add(word, delta, __ATOMIC_ACQ_REL);
}

// Lets the loader check that it talks to this file's ABI.
int64_t odc_atomics_abi_version() { return 1; }

}  // extern "C"
