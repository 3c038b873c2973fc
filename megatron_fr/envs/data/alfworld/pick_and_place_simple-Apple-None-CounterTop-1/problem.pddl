;; Hand-written in ALFWorld's format (ALFRED ids, its alfred domain): a kitchen with a
;; countertop, a dining table and a fridge; the task: put the apple in the countertop.
(define (problem plan_trial_1)
    (:domain alfred)
    (:objects
        agent1 - agent
        AppleType - otype
        MugType - otype
        CounterTopType - rtype
        DiningTableType - rtype
        FridgeType - rtype
        Apple_bar__minus_02_dot_10_bar__plus_00_dot_80_bar__plus_01_dot_40 - object
        Mug_bar__plus_01_dot_10_bar__plus_00_dot_90_bar__minus_01_dot_00 - object
        CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_95_bar__minus_01_dot_00 - receptacle
        DiningTable_bar__minus_02_dot_00_bar__plus_00_dot_75_bar__plus_01_dot_50 - receptacle
        Fridge_bar__minus_01_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_50 - receptacle
        loc_bar_0_bar_0_bar_0_bar_30 - location
        loc_bar_4_bar__minus_3_bar_1_bar_45 - location
        loc_bar__minus_6_bar_5_bar_3_bar_45 - location
        loc_bar__minus_5_bar__minus_8_bar_2_bar_30 - location
    )
    (:init
        (atLocation agent1 loc_bar_0_bar_0_bar_0_bar_30)
        (receptacleType CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_95_bar__minus_01_dot_00 CounterTopType)
        (receptacleAtLocation CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_95_bar__minus_01_dot_00 loc_bar_4_bar__minus_3_bar_1_bar_45)
        (receptacleType DiningTable_bar__minus_02_dot_00_bar__plus_00_dot_75_bar__plus_01_dot_50 DiningTableType)
        (receptacleAtLocation DiningTable_bar__minus_02_dot_00_bar__plus_00_dot_75_bar__plus_01_dot_50 loc_bar__minus_6_bar_5_bar_3_bar_45)
        (receptacleType Fridge_bar__minus_01_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_50 FridgeType)
        (receptacleAtLocation Fridge_bar__minus_01_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_50 loc_bar__minus_5_bar__minus_8_bar_2_bar_30)
        (openable Fridge_bar__minus_01_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_50)
        (objectType Apple_bar__minus_02_dot_10_bar__plus_00_dot_80_bar__plus_01_dot_40 AppleType)
        (objectAtLocation Apple_bar__minus_02_dot_10_bar__plus_00_dot_80_bar__plus_01_dot_40 loc_bar__minus_6_bar_5_bar_3_bar_45)
        (inReceptacle Apple_bar__minus_02_dot_10_bar__plus_00_dot_80_bar__plus_01_dot_40 DiningTable_bar__minus_02_dot_00_bar__plus_00_dot_75_bar__plus_01_dot_50)
        (pickupable Apple_bar__minus_02_dot_10_bar__plus_00_dot_80_bar__plus_01_dot_40)
        (coolable Apple_bar__minus_02_dot_10_bar__plus_00_dot_80_bar__plus_01_dot_40)
        (objectType Mug_bar__plus_01_dot_10_bar__plus_00_dot_90_bar__minus_01_dot_00 MugType)
        (objectAtLocation Mug_bar__plus_01_dot_10_bar__plus_00_dot_90_bar__minus_01_dot_00 loc_bar_4_bar__minus_3_bar_1_bar_45)
        (inReceptacle Mug_bar__plus_01_dot_10_bar__plus_00_dot_90_bar__minus_01_dot_00 CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_95_bar__minus_01_dot_00)
        (pickupable Mug_bar__plus_01_dot_10_bar__plus_00_dot_90_bar__minus_01_dot_00)
        (canContain CounterTopType AppleType)
        (canContain CounterTopType MugType)
        (canContain DiningTableType AppleType)
        (canContain DiningTableType MugType)
        (canContain FridgeType AppleType)
        (canContain FridgeType MugType)
    )
    (:goal
        (and
            (exists (?r - receptacle)
                (exists (?o - object)
                    (and
                        (objectType ?o AppleType)
                        (receptacleType ?r CounterTopType)
                        (inReceptacle ?o ?r)
                    )
                )
            )
        )
    )
)
