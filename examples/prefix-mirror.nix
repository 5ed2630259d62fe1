# NixOS module snippet: the nightly prefix-registry mirror and its weekly full verify (the
# same as prefix-mirror.service/.timer and prefix-mirror-full.service/.timer). Import it
# from configuration.nix and set `prefixreg` to the package that provides bin/prefix-mirror
# (it needs rsync and openssh on PATH; a worker needs rsync, find and sha256sum).
{ config, lib, pkgs, prefixreg, ... }:

let
  # Space-separated destinations: [user@]host:path over ssh, or a local path. Each must be
  # empty or already a mirror, and its parent must exist.
  localDestinations = [ "/srv/prefix-mirror" ];
  destinations = [
    "prefixreg@worker-1:/var/lib/prefixreg/mirror"
    "prefixreg@worker-2:/var/lib/prefixreg/mirror"
  ] ++ localDestinations;
  mirrorService = args: {
    wants = [ "network-online.target" ];
    after = [ "network-online.target" ];
    path = [ pkgs.rsync pkgs.openssh pkgs.coreutils pkgs.findutils ];
    environment = {
      PREFIXREG_HOME = "/var/lib/prefixreg/registry";
      PREFIXREG_MIRROR_TO = lib.concatStringsSep " " destinations;
      PREFIXREG_SSH_OPTS = "IdentityFile=/var/lib/prefixreg/.ssh/id_ed25519 UserKnownHostsFile=/var/lib/prefixreg/.ssh/known_hosts StrictHostKeyChecking=yes";
    };
    serviceConfig = {
      Type = "oneshot";
      User = "prefixreg";
      # Exit 0: all verified (every object hashed at each destination); 6: a destination
      # failed or was refused (e.g. a missing parent directory); 3: an origin object failed
      # verification, nothing sent; 7: another mirror held the lock.
      ExecStart = "${prefixreg}/bin/prefix-mirror${args}";
      TimeoutStartSec = "4h";
      Nice = 10;
      IOSchedulingClass = "idle";
      # ProtectSystem=strict leaves only ReadWritePaths writable: the registry (mirror.log,
      # lock) and every local destination.
      ProtectSystem = "strict";
      ReadWritePaths = [ "/var/lib/prefixreg/registry" ] ++ localDestinations;
      ProtectHome = true;
      PrivateTmp = true;
      NoNewPrivileges = true;
    };
  };
in
{
  users.users.prefixreg = {
    isSystemUser = true;
    group = "prefixreg";
    home = "/var/lib/prefixreg";
  };
  users.groups.prefixreg = { };

  systemd.services.prefix-mirror = mirrorService "" // {
    description = "Mirror the prompt-prefix registry to the workers (rsync -a --delete, verified)";
  };
  systemd.services.prefix-mirror-full = mirrorService " --full-verify" // {
    description = "Mirror the prompt-prefix registry to the workers, re-hashing the origin too";
  };

  # Nightly, and weekly with --full-verify (after the nightly run).
  systemd.timers.prefix-mirror = {
    description = "Nightly prompt-prefix registry mirror";
    wantedBy = [ "timers.target" ];
    timerConfig = { OnCalendar = "*-*-* 03:15:00"; RandomizedDelaySec = "15m"; Persistent = true; };
  };
  systemd.timers.prefix-mirror-full = {
    description = "Weekly prompt-prefix registry mirror with --full-verify";
    wantedBy = [ "timers.target" ];
    timerConfig = { OnCalendar = "Sun *-*-* 05:00:00"; Persistent = true; };
  };
}
