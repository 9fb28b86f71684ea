"""Virtual machines for sandboxes: a pure description (`spec`), the guest kit (kernel + our
initramfs, `kit`), the QEMU runner (`qemu`) and guest-side composition (`compose`). The sandbox
backends that use them live in `runtime_shim.backends` (`microvm`, `vm`). See docs/vm.md."""
