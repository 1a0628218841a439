/**
 * Loads shoal's kernel library into this process (ort-kernels.c: its Node addon entry wraps
 * onnxruntime's API table, so every session made after, on any thread, knows the kernel's ops).
 */
// onnxruntime-node's binding loads onnxruntime's library, which the kernel library finds (RTLD_NOLOAD) to wrap.
import 'onnxruntime-node'

const loaded = new Set<string>()

/**
 * Loads the library into this process (once a thread). Every onnxruntime session made after, on any thread, knows
 * the kernel's ops. Throws where the library does not load.
 */
export function loadKernelLibrary (lib: string): void {
  if (loaded.has(lib)) return
  process.dlopen({ exports: {} }, lib)
  loaded.add(lib)
}
